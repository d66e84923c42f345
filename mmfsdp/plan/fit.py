"""Which configurations fit a memory budget: ``python -m mmfsdp.plan CONFIG --fit-memory 24GiB``.

Every world size x strategy x activation checkpointing is tried; candidates are
listed cheapest first (``docs/plan.md``).
"""
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..wrappers.builder import resolve_wrapper
from ..wrappers.ddp import NAME as DDP
from ..wrappers.fsdp import NAME as FSDP1
from ..wrappers.fsdp2 import NAME as FSDP2
from .memory import Plan
from .step import StepPeak, step_peak
from .trace import BatchFn, StepTrace

__all__ = ['Candidate', 'candidates', 'fit', 'parse_bytes']

#: (label, wrapper type, options), in the order of their communication cost.
STRATEGIES: Tuple[Tuple[str, str, Dict[str, Any]], ...] = (
    ('DDP', DDP, {}),
    ('FSDP1 SHARD_GRAD_OP', FSDP1, dict(sharding_strategy='SHARD_GRAD_OP')),
    ('FSDP2 reshard_after_forward=False', FSDP2, dict(reshard_after_forward=False)),
    ('FSDP1 FULL_SHARD', FSDP1, dict(sharding_strategy='FULL_SHARD')),
    ('FSDP2 reshard_after_forward=True', FSDP2, dict(reshard_after_forward=True)),
)
_UNITS = {'': 1, 'b': 1, 'k': 10**3, 'kb': 10**3, 'm': 10**6, 'mb': 10**6, 'g': 10**9,
          'gb': 10**9, 't': 10**12, 'tb': 10**12, 'kib': 2**10, 'mib': 2**20, 'gib': 2**30,
          'tib': 2**40}


def parse_bytes(text: str) -> int:
    """``'24GiB'`` -> 25769803776; decimal (GB) and binary (GiB) units, case-insensitive."""
    match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*', text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f'--fit-memory: cannot read {text!r} as a size; write e.g. 24GiB, '
                         '80GB or 512MiB')
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class Candidate:
    """One configuration tried: a strategy, a world size, checkpointing on or off."""

    label: str
    wrapper_cfg: Mapping[str, Any]
    world_size: int
    checkpointing: bool
    step: StepPeak

    @property
    def peak_bytes(self) -> int:
        """The predicted step peak per rank."""
        return self.step.total_bytes


def candidates(wrapper_cfg: Mapping[str, Any], model: nn.Module,
               checkpoint_layer_cls: Sequence[str]) -> List[Tuple[str, Dict[str, Any], bool]]:
    """``(label, model_wrapper_cfg, checkpointing)`` of every strategy x checkpointing setting."""
    common: Dict[str, Any] = {}
    if wrapper_cfg.get('auto_wrap_policy') is not None:
        common['auto_wrap_policy'] = wrapper_cfg['auto_wrap_policy']
    precision = dict(wrapper_cfg.get('mixed_precision') or {})
    if precision:  # what both FSDP wrappers take: the dtypes, the modules kept in fp32
        common['mixed_precision'] = {k: v for k, v in precision.items()
                                     if k in ('param_dtype', 'reduce_dtype', 'fp32_modules')}
    out = []
    for label, kind, options in STRATEGIES:
        for checkpointing in (False, True):
            if checkpointing and not checkpoint_layer_cls:
                continue
            cfg = dict(type=kind) if kind == DDP else dict(type=kind, **common, **options)
            if checkpointing:
                cfg['activation_checkpointing'] = dict(layer_cls=list(checkpoint_layer_cls))
            out.append((label, cfg, checkpointing))
    return out


def fit(model: nn.Module, wrapper_cfg: Mapping[str, Any], scope: str, batch: BatchFn,
        batch_size: int, world_sizes: Sequence[int], checkpoint_layer_cls: Sequence[str],
        optimizer_cfg: Optional[Mapping[str, Any]] = None, ema: bool = False,
        budget: Optional[int] = None, heap_threshold: Optional[int] = None,
        accumulative_counts: int = 1, autocast: Optional[torch.dtype] = None) -> List[Candidate]:
    """Every candidate at every world size, cheapest first (only those within ``budget``).

    ``heap_threshold``: training on a CPU host (:func:`.host.heap_threshold`);
    ``accumulative_counts``, ``autocast``: the optim wrapper's micro-steps per
    optimizer step and AMP dtype.
    """
    from . import plan_of, trace_of
    traces: Dict[Tuple[Any, ...], StepTrace] = {}
    found = []
    optim_wrapper = dict(optimizer=optimizer_cfg or {}, accumulative_counts=accumulative_counts)
    # FSDP candidates first into the cache: their traces attribute activations to units
    tried = candidates(wrapper_cfg, model, checkpoint_layer_cls)
    for label, cfg, checkpointing in sorted(tried, key=lambda c: c[1]['type'] == DDP):
        wrapping = resolve_wrapper(cfg, scope)  # once per candidate, laid out once
        layout = wrapping.layout(model)
        key = (checkpointing, repr(cfg.get('mixed_precision')))  # what the trace depends on
        if key not in traces:
            traces[key] = trace_of(wrapping, layout, model, batch, autocast=autocast)
        for n in world_sizes:
            plan: Plan = plan_of(wrapping, layout, model, n, optim_wrapper, ema)
            step = step_peak(plan, traces[key], batch_size, heap_threshold)
            if budget is None or step.total_bytes <= budget:
                found.append(Candidate(label, cfg, n, checkpointing, step))
    order = {label: i for i, (label, _, _) in enumerate(STRATEGIES)}
    return sorted(found, key=lambda c: (c.world_size, c.checkpointing, order[c.label],
                                        c.peak_bytes))
