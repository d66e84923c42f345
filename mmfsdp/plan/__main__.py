"""Dry run: ``python -m mmfsdp.plan CONFIG --world-size 1 8 64 [--cfg-options ...]``.

Builds the model on the meta device, prints the plan per world size, then traces
one step for its peak per rank (``--fit-memory``: what fits). See ``docs/plan.md``.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from mmengine.config import DictAction
from mmengine.registry import MODELS, DefaultScope
from torch import nn

import mmfsdp  # noqa: F401  (fills the registries)

from ..amp import autocast_dtype
from ..checkpointing import AC_KEY, ActivationCheckpointing
from ..dist import current_device
from ..ema import configures_ema
from ..meta_init import empty_weights
from ..policies import ModelIndex
from ..registry import load_config
from ..runner import revert_sync_bn
from ..wrappers.base import Layout
from ..wrappers.builder import model_wrapper_config, resolve_wrapper
from . import format_plan, plan_of, plan_to_dict, step_peak, trace_of
from .allocator import ALLOCATORS, heap_threshold, launch_allocator
from .batch import config_batch, shape_batch
from .fit import fit, parse_bytes
from .report import format_step, size_text

PROG = 'python -m mmfsdp.plan'
DTYPES = dict(float32=torch.float32, float16=torch.float16, bfloat16=torch.bfloat16,
              int64=torch.int64, int32=torch.int32, uint8=torch.uint8)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split('\n\n')[0])
    parser.add_argument('config', help='an mmengine config file')
    parser.add_argument('--world-size', type=int, nargs='+', default=[1, 8, 64])
    parser.add_argument('--format', choices=['table', 'json'], default='table')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default={},
                        help='override settings of the config, as key=value pairs')
    parser.add_argument('--batch-size', type=int, help='samples per rank (default: '
                        'train_dataloader.batch_size)')
    parser.add_argument('--activation-checkpointing', nargs='+', metavar='off|on|LAYER_CLS',
                        help="'off', 'on' (the configured layer classes, else the classes of "
                        "the wrap policy's units) or layer class names")
    parser.add_argument('--input-shape', help='trace on inputs of this shape (e.g. 8,3,224,224) '
                        "in mode='tensor' instead of a dataset sample")
    parser.add_argument('--input-dtype', choices=sorted(DTYPES), default='float32')
    parser.add_argument('--fit-memory', metavar='SIZE', help='list the world sizes, strategies '
                        'and checkpointing settings whose peak per rank fits, e.g. 24GiB')
    parser.add_argument('--device', help="the device type the run trains on, e.g. cpu or cuda "
                        '(default: where it would train on this machine); on cpu the peak '
                        'counts the freed blocks that the allocator keeps resident')
    parser.add_argument('--cpu-allocator', choices=['auto', *ALLOCATORS], default='auto',
                        help="the malloc of a CPU run (default 'auto': what tools/dist_train.sh "
                        'preloads on this machine, MMFSDP_CPU_ALLOCATOR and LD_PRELOAD included)')
    parser.add_argument('--no-trace', action='store_true',
                        help='model states only: do not trace a training step')
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Command-line entry point."""
    args = _parser().parse_args(argv)
    budget = parse_bytes(args.fit_memory) if args.fit_memory else None
    # stdout carries the plan alone (JSON for scripts); mmengine logs to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        text, data = _run(args, budget)
    _print(json.dumps(data, indent=1) if args.format == 'json' else text)


def model_config(cfg: Any) -> Any:
    """``cfg.model`` as mmengine's ``Runner`` builds it (the config itself is left as it is).

    A top-level ``data_preprocessor`` (mmpretrain's shipped configs have one)
    is the model's unless the model config names its own.
    """
    model = cfg.model
    preprocessor = cfg.get('data_preprocessor')
    if isinstance(model, dict) and preprocessor is not None and 'data_preprocessor' not in model:
        model = dict(model, data_preprocessor=preprocessor)
    return model


def build_model(cfg: Any, scope: str, device: str) -> Tuple[nn.Module, List[str]]:
    """The config's model on the meta device, as ``FSDPRunner`` builds it to train on ``device``.

    On a CPU host SyncBN becomes BatchNorm, as ``FSDPRunner.build_model``
    converts it there (:func:`mmfsdp.runner.revert_sync_bn`): returns the model
    and the names of the modules converted.
    """
    with DefaultScope.overwrite_default_scope(scope), empty_weights(record=False):
        model = MODELS.build(model_config(cfg))
    if device != 'cpu':
        return model, []
    return revert_sync_bn(model)


def _unit_classes(model: nn.Module, units: Sequence[str]) -> List[str]:
    return list(dict.fromkeys(type(model.get_submodule(u)).__name__ for u in units))


def _checkpointing(choice: Optional[List[str]], wrapper_cfg: Mapping[str, Any],
                   model: nn.Module, units: Sequence[str]) -> List[str]:
    """The layer classes to checkpoint: the config's, or the what-if's."""
    configured = list((wrapper_cfg.get('activation_checkpointing') or {}).get('layer_cls', []))
    if not choice:
        return configured
    if choice == ['off']:
        return []
    classes = choice if choice != ['on'] else configured or _unit_classes(model, units)
    if not classes:
        raise ValueError(f"--activation-checkpointing on: {AC_KEY} is not set and the wrap "
                         'policy makes no units; name the layer classes instead')
    return classes


def _run(args: argparse.Namespace, budget: Optional[int]) -> Tuple[str, Any]:
    cfg = load_config(args.config)
    cfg.merge_from_dict(args.cfg_options)
    scope = cfg.get('default_scope', 'mmengine')
    wrapping = resolve_wrapper(model_wrapper_config(cfg), scope)  # once, as FSDPRunner does
    device = args.device or current_device().type
    model, converted = build_model(cfg, scope, device)
    if converted:  # as FSDPRunner logs it
        print(f'SyncBatchNorm needs an accelerator and {device!r} is not one: planned as '
              f'BatchNorm, as FSDPRunner converts them there ({len(converted)} modules: '
              f"{', '.join(converted)})", file=sys.stderr)
    optim_wrapper = cfg.get('optim_wrapper') or {}
    ema = configures_ema(cfg.get('custom_hooks'))
    allocator = args.cpu_allocator
    if device == 'cpu' and allocator == 'auto':
        allocator = launch_allocator()
    heap = heap_threshold(device, 'glibc' if allocator == 'auto' else allocator)
    layout = wrapping.layout(model)  # once: the layout does not depend on the world size
    # the policy's units; not the modules kept in fp32 (a BatchNorm recomputed in backward
    # would update its running statistics twice)
    units = list(layout.units) if layout is not None else []
    checkpoint = _checkpointing(args.activation_checkpointing, wrapping.options, model, units)
    if args.activation_checkpointing and budget is None:  # --fit-memory tries them all
        layout = _checkpointed(layout, model, checkpoint)
    plans = [plan_of(wrapping, layout, model, n, optim_wrapper, ema) for n in args.world_size]
    if args.no_trace and budget is None:
        return '\n\n'.join(format_plan(p) for p in plans), [plan_to_dict(p) for p in plans]
    # what --fit-memory checkpoints: the configured layers, else the units' classes (a
    # detector's backbone and encoder blocks), else the model's repeated blocks ('auto')
    layers, chosen = checkpoint, f'{AC_KEY}.layer_cls'
    if not layers:
        layers, chosen = _unit_classes(model, units), "the wrap policy's units"
    if not layers:
        blocks, why = ModelIndex(model).auto_blocks
        layers = [c.__name__ for c in blocks]
        chosen = f"the model's {why.removeprefix('the ')}, layer_cls='auto'"
    failed = None
    with DefaultScope.overwrite_default_scope(scope):
        amp = autocast_dtype(optim_wrapper)  # once: what optim_context autocasts to
        try:
            batch, size, source = _batch(args, cfg, scope)
        except Exception as e:  # the batch needs the dataset's files
            failed = (f'{type(e).__name__}: {e} (where the training dataset is not on this '
                      'machine, --input-shape gives the inputs directly, e.g. 32,3,224,224)')
        else:
            try:
                if budget is not None:
                    found = fit(model, wrapping.options, scope, batch, size, args.world_size,
                                layers, optim_wrapper.get('optimizer'), ema, heap_threshold=heap,
                                accumulative_counts=optim_wrapper.get('accumulative_counts', 1),
                                autocast=amp)
                else:
                    trace = trace_of(wrapping, layout, model, batch, args.world_size[0], amp)
            except Exception as e:  # the model's code, traced: say where
                failed = f'tracing the training step failed: {type(e).__name__}: {e}'
    if failed and budget is not None:  # nothing to list without a traced step: say why, briefly
        raise SystemExit(f'{PROG}: error: --fit-memory needs one training step traced; {failed}')
    if failed:  # the model states still hold: print them, and why no step
        reason = f'activations not traced: {failed}; --no-trace skips the trace'
        return ('\n\n'.join(format_plan(p) + '\n' + reason for p in plans),
                [dict(plan_to_dict(p), step=None, step_error=reason) for p in plans])
    if budget is not None:
        return (_fit_text(found, budget, size, layers, chosen) + f'\nbatch: {source}',
                _fit_json(found, budget, source))
    steps = [step_peak(p, trace, size, heap) for p in plans]
    text = '\n\n'.join(f'{format_plan(p)}\n{format_step(s)}\nbatch: {source}'
                       for p, s in zip(plans, steps))
    return text, [dict(plan_to_dict(p), step=dict(s.to_dict(), batch=source))
                  for p, s in zip(plans, steps)]


def _batch(args: argparse.Namespace, cfg: Any, scope: str) -> Tuple[Any, int, str]:
    """The traced step's batch, its size per rank and what it stands for."""
    if args.input_shape:
        shape = [int(s) for s in args.input_shape.replace('x', ',').split(',')]
        return (*shape_batch(shape, DTYPES[args.input_dtype], args.batch_size),
                f"inputs of shape {args.input_shape} (--input-shape), mode='tensor'")
    notes: List[str] = []
    batch = config_batch(cfg.get('train_dataloader') or {}, scope, args.batch_size, notes)
    largest = f" at the pipeline's largest scale ({'; '.join(notes)})" if notes else ''
    return (*batch, f'one sample of train_dataloader.dataset{largest}, repeated')


def _checkpointed(layout: Optional[Layout], model: nn.Module, layer_cls: List[str]) -> Any:
    """``layout`` with the what-if's checkpointed layers (``[]``: none), without a new walk."""
    if layout is None:  # not mmfsdp's wrapper: plan_of says so
        return layout
    classes = ModelIndex(model).classes_of(layer_cls, f'{AC_KEY}.layer_cls') if layer_cls else ()
    return dataclasses.replace(
        layout, checkpoint_layers=classes,
        checkpointing=ActivationCheckpointing(layer_cls=tuple(layer_cls)) if classes else None)


def _fit_json(found: list, budget: int, source: str) -> List[Dict[str, Any]]:
    return [dict(world_size=c.world_size, strategy=c.label, model_wrapper_cfg=c.wrapper_cfg,
                 fits=c.peak_bytes <= budget, batch=source, **c.step.to_dict()) for c in found]


def _fit_text(found: list, budget: int, batch_size: int, layers: Sequence[str] = (),
              chosen: str = '') -> str:
    fits = [c for c in found if c.peak_bytes <= budget]
    head = f'{"world size":>10}  {"strategy":<34} {"AC":<4} {"peak/rank":>10} ' \
           f'{"states":>10} {"gathered":>10} {"activations":>11} {"transient":>10}'
    lines = [f'fits in {size_text(budget)} per rank with batch {batch_size} per rank '
             f'({len(fits)} of {len(found)} configurations, cheapest first):', head]
    for c in fits:
        s = c.step
        lines.append(f'{c.world_size:>10}  {c.label:<34} {"on" if c.checkpointing else "off":<4} '
                     f'{size_text(s.total_bytes):>10} {size_text(s.model_state_bytes):>10} '
                     f'{size_text(s.gathered_bytes):>10} {size_text(s.activation_bytes):>11} '
                     f'{size_text(s.transient_bytes):>10}')
    if fits:
        best = fits[0]
        lines.append(f'smallest that fits: {best.world_size} ranks, {best.label}, activation '
                     f'checkpointing {"on" if best.checkpointing else "off"}: '
                     f'model_wrapper_cfg={best.wrapper_cfg!r}')
    else:
        low = min(found, key=lambda c: c.peak_bytes)
        lines.append(f'nothing fits; the lowest peak is {size_text(low.peak_bytes)} per rank '
                     f'({low.world_size} ranks, {low.label}, activation checkpointing '
                     f'{"on" if low.checkpointing else "off"}): try more ranks or a smaller '
                     'batch (--world-size, --batch-size)')
    if layers:
        lines.append(f"AC on checkpoints {', '.join(layers)} ({chosen})")
    else:
        lines.append(f'activation checkpointing not tried: {AC_KEY} is not set, the wrap '
                     'policy makes no units and no block repeats; name the layer classes to '
                     'checkpoint with --activation-checkpointing LAYER_CLS')
    return '\n'.join(lines)


def _print(text: str) -> None:
    """Print ``text``; a reader that stops early (``| head``) ends the program quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would report the failed flush of stdout again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == '__main__':
    main()
