"""A plan as a table for people, a JSON object for scripts, and warnings for mistakes."""
import collections
from typing import TYPE_CHECKING, Any, Dict, List

import torch

from .memory import Plan

if TYPE_CHECKING:  # the tracer is imported where a step is traced, not with the plan
    from .step import StepPeak

__all__ = ['ROOT_SHARE_LIMIT', 'UNIT_COUNT_LIMIT', 'format_plan', 'format_step', 'plan_to_dict',
           'plan_warnings']

#: Warn when the root unit keeps more than this share of the parameters.
ROOT_SHARE_LIMIT = 0.5
#: Warn when a plan has more units than this.
UNIT_COUNT_LIMIT = 1000


def size_text(n: float) -> str:
    """Bytes for people: ``1.5 GiB``."""
    for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
        if abs(n) < 1024 or unit == 'TiB':
            return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
        n /= 1024
    raise AssertionError('unreachable')


def _count(n: int) -> str:
    for scale, suffix in ((1e9, 'B'), (1e6, 'M'), (1e3, 'K')):
        if n >= scale:
            return f'{n / scale:.2f}{suffix}'
    return str(n)


def plan_warnings(plan: Plan) -> List[str]:
    """Policy mistakes worth a warning, each saying which knob to turn."""
    warnings = []
    sharded_units = len(plan.units) - 1
    if plan.spec.shard_size > 1 and plan.numel and plan.root.numel > ROOT_SHARE_LIMIT * plan.numel:
        warnings.append(
            f'the root unit keeps {plan.root.numel / plan.numel:.0%} of the parameters, so each '
            f'forward gathers them all at once: wrap the large layers in their own units '
            "(auto_wrap_policy='auto', dict(type='transformer', layer_cls=[...]) or a lower "
            'size_based min_num_params)')
    if sharded_units > UNIT_COUNT_LIMIT:
        warnings.append(
            f'{sharded_units} units: so many small all-gathers cost latency; wrap larger '
            'layers (fewer layer_cls, or a higher size_based min_num_params)')
    return warnings


def plan_to_dict(plan: Plan) -> Dict[str, Any]:
    """The plan as plain JSON-able values."""
    spec = plan.spec
    return dict(
        world_size=plan.world_size, wrapper=spec.wrapper, strategy=spec.strategy,
        mesh=dict(replicate=spec.replicate_size, shard=spec.shard_size),
        numel=plan.numel, unsharded_bytes=plan.unsharded_bytes,
        model_state_bytes_per_rank=plan.model_state_bytes_per_rank,
        ema_bytes_per_rank=plan.ema_bytes_per_rank,
        peak_bytes_per_rank_estimate=plan.peak_bytes_per_rank_estimate,
        construction=spec.construction.name.lower(),
        construction_peak_bytes_per_rank=plan.construction_bytes_per_rank,
        largest_unit=plan.largest_unit.name or '(root)',
        root_modules=list(plan.root_modules),
        shared_parameters=[list(group) for group in plan.shared],
        warnings=plan_warnings(plan),
        units=[dict(name=u.name or '(root)', cls=u.cls, numel=u.numel, param_bytes=u.param_bytes,
                    grad_bytes=u.grad_bytes, optimizer_bytes=u.optimizer_bytes,
                    gathered_bytes=u.gathered_bytes, reduced_bytes=u.reduced_bytes,
                    reduce_dtype=_dtype_text(u.reduce_dtype) if u.reduce_dtype else None)
               for u in plan.units])


def format_plan(plan: Plan, max_rows: int = 40, with_warnings: bool = True) -> str:
    """One compact table: units in module order, totals, the unsharded equivalent."""
    spec = plan.spec
    lines = [f'{spec.wrapper} {spec.strategy}, world size {plan.world_size} '
             f'(mesh replicate={spec.replicate_size} x shard={spec.shard_size}), '
             f'{len(plan.units) - 1} units + root, {_count(plan.numel)} parameters']
    header = f"{'unit':<32} {'class':<20} {'params':>8} {'param/rank':>11} " \
             f"{'grad/rank':>11} {'optim/rank':>11}"
    lines += [header, '-' * len(header)]
    rows = list(plan.units)
    shown = rows if len(rows) <= max_rows else rows[:max_rows // 2] + rows[-max_rows // 2:]
    for i, u in enumerate(shown):
        if len(rows) > max_rows and i == max_rows // 2:
            lines.append(f'... {len(rows) - max_rows} more units ...')
        name = u.name or '(root)'
        lines.append(f'{name[-32:]:<32} {u.cls[:20]:<20} {_count(u.numel):>8} '
                     f'{size_text(u.param_bytes):>11} {size_text(u.grad_bytes):>11} '
                     f'{size_text(u.optimizer_bytes):>11}')
    lines.append('-' * len(header))
    lines.append(f"{'total per rank':<32} {'':<20} {_count(plan.numel):>8} "
                 f'{size_text(sum(u.param_bytes for u in rows)):>11} '
                 f'{size_text(sum(u.grad_bytes for u in rows)):>11} '
                 f'{size_text(sum(u.optimizer_bytes for u in rows)):>11}')
    if plan.ema_bytes_per_rank:
        lines.append(f'EMA (EMAHook) per rank {size_text(plan.ema_bytes_per_rank)}: the averaged '
                     'copy of this rank\'s parameter shards only')
    lines.append(f'model states per rank {size_text(plan.model_state_bytes_per_rank)} '
                 f'(unsharded: {size_text(plan.unsharded_bytes)}); largest unit '
                 f"{plan.largest_unit.name or '(root)'} gathers "
                 f'{size_text(plan.largest_unit.gathered_bytes)}; peak estimate '
                 f'{size_text(plan.peak_bytes_per_rank_estimate)} per rank (activations not '
                 'included)')
    lines.append(f'construction peak {size_text(plan.construction_bytes_per_rank)} per rank of '
                 f'parameters on the device ({plan.spec.construction.value})')
    lines.append(_reductions(plan))
    named = [u for u in rows if u.name]
    if named:  # the classes of the units, and the share of the parameters each class holds
        held = collections.Counter()
        for u in named:
            held[u.cls] += u.numel
        lines.append((f"auto_wrap_policy='auto' chose {spec.auto_units}: " if spec.auto_units
                      else 'units: ') + ', '.join(
            f'{sum(u.cls == cls for u in named)} x {cls} ({n / plan.numel:.0%} of the parameters)'
            for cls, n in held.items()))
    if plan.spec.units and plan.root_modules:
        shown_modules = ', '.join(plan.root_modules[:12])
        more = len(plan.root_modules) - 12
        lines.append(f'left in the root unit: {shown_modules}' +
                     (f' and {more} more' if more > 0 else ''))
    if plan.shared:
        lines.append('shared parameters (one tensor, one unit): ' +
                     '; '.join(' = '.join(group) for group in plan.shared))
    if with_warnings:
        lines += [f'warning: {w}' for w in plan_warnings(plan)]
    return '\n'.join(lines)


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace('torch.', '')


def _reductions(plan: Plan) -> str:
    """Which dtype each unit's gradients are reduced in: ``gradients reduced in bf16 (...)``."""
    by_dtype: Dict[str, List[str]] = collections.defaultdict(list)
    for u in plan.units:
        if u.reduce_dtype is not None:
            by_dtype[_dtype_text(u.reduce_dtype)].append(u.name or '(root)')
    if not by_dtype:
        return 'gradients: none (every parameter is frozen)'
    collective = ('all-reduce' if plan.spec.shard_size == 1
                  else 'reduce-scatter' if plan.spec.replicate_size == 1
                  else 'reduce-scatter + all-reduce')
    parts = [f'{dtype} ({"every unit" if len(by_dtype) == 1 else _names(names)})'
             for dtype, names in by_dtype.items()]
    return f'gradients reduced ({collective}) in ' + '; '.join(parts)


def _names(names: List[str], shown: int = 4) -> str:
    more = len(names) - shown
    return ', '.join(names[:shown]) + (f' and {more} more' if more > 0 else '')


def format_step(step: 'StepPeak', max_units: int = 8) -> str:
    """The training step's peak and its parts (the lines under a plan's table)."""
    trace = step.trace
    checkpointed = ', '.join(trace.checkpointed) or 'off'
    dtype = str(trace.compute_dtype).replace('torch.', '') + (
        f' under autocast to {trace.autocast_dtype}'.replace('torch.', '')
        if trace.autocast_dtype else '')
    units = sorted(trace.by_unit.items(), key=lambda kv: -kv[1])
    shown = ', '.join(f"{name or '(root)'} {size_text(n)}" for name, n in units[:max_units])
    more = len(units) - max_units
    return '\n'.join([
        f'training step, batch {step.batch_size} per rank (activation checkpointing: '
        f'{checkpointed}; computing in {dtype}): peak {size_text(step.total_bytes)} per rank = '
        f'model states {size_text(step.model_state_bytes)} + gathered units '
        f'{size_text(step.gathered_bytes)} + activations {size_text(step.activation_bytes)} + '
        f'largest transient {size_text(step.transient_bytes)}',
        'activations kept for backward, by unit: ' + shown +
        (f' and {more} more' if more > 0 else '')] +
        ([f'measured on real CPU tensors, not traced (the code needs tensor values; random '
          f"weights, the batch's own targets): {'; '.join(trace.real_parts)}"]
         if trace.real_parts else []) +
        ([f'gradients ({size_text(step.freed_grad_bytes)}) are freed between steps: backward '
          'creates them as it frees the activations, so the peak counts the larger of the two']
         if step.freed_grad_bytes else []) +
        ([f'CPU heap: {size_text(step.heap_activation_bytes)} of the activations are in blocks '
          f'below the heap threshold ({size_text(step.heap_threshold or 0)}) and stay resident '
          'after backward frees them: counted apart from that comparison']
         if step.heap_activation_bytes and step.freed_grad_bytes else []) +
        ([f'CPU: gloo stages a whole unit ({size_text(step.staging_bytes)}) in every all-gather '
          'and reduce-scatter; the largest transient is the larger of that and the traced '
          f'rise in backward ({size_text(step.trace.transient_bytes)})']
         if step.staging_bytes else []))
