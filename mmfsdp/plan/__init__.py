"""Know before you launch: the sharding plan of a model and its memory per rank.

- :mod:`.memory`: bytes per rank of parameters, gradients, optimizer state,
  from a wrapper's :class:`~mmfsdp.plan.spec.ShardingSpec` (:mod:`.spec`);
- :mod:`.report`: the table, the JSON object and the warnings;
- :mod:`.trace`, :mod:`.batch`, :mod:`.step`: activations of one training step
  traced with fake tensors, and the step's peak per rank (imported on first
  use: ``import mmfsdp`` does not load the tracer);
- :mod:`.allocator`: what a CPU host's allocator keeps resident beyond the live tensors;
- :mod:`.fit`: the configurations whose peak fits a memory budget;
- ``python -m mmfsdp.plan CONFIG --world-size 1 8 64``: a dry run on the meta device.
"""
import dataclasses
import functools
import importlib
import logging
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..wrappers.base import Layout
from ..wrappers.builder import Wrapping, resolve_wrapper
from .memory import Plan, Unit, make_plan, optimizer_states_per_param
from .report import format_plan, plan_to_dict, plan_warnings
from .spec import Construction, Padding, ShardingSpec, sharding_spec

__all__ = ['BatchFn', 'Construction', 'Padding', 'Plan', 'ShardingSpec', 'StepPeak', 'StepTrace',
           'Unit', 'format_plan', 'heap_threshold', 'log_sharding_plan', 'make_plan',
           'optimizer_states_per_param', 'plan_for', 'plan_of', 'plan_to_dict', 'plan_warnings',
           'step_peak', 'trace_for', 'trace_of', 'trace_step']

#: Names served from the tracer's modules on first use (PEP 562).
_LAZY = dict(BatchFn='.trace', StepTrace='.trace', trace_step='.trace', StepPeak='.step',
             step_peak='.step', heap_threshold='.allocator')


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def _wrapping(wrapper_cls: type, wrapper_cfg: Mapping[str, Any]) -> Wrapping:
    return resolve_wrapper(dict(wrapper_cfg, type=wrapper_cls))


def reduce_dtype_of(wrapping: Wrapping) -> Optional[torch.dtype]:
    """The dtype the wrapper reduces gradients in (``None``: the parameters' own).

    FSDP1's ``MixedPrecision`` reduces in ``param_dtype`` when ``reduce_dtype``
    is not given; mmfsdp's FSDP2 config writes that out in its resolved policy
    (:func:`~mmfsdp.wrappers.fsdp2.resolve_mp_policy`: torch 2.15's FSDP2 would
    reduce in the gradients' dtype).
    """
    precision = getattr(wrapping.config, 'mixed_precision', None)
    if precision is None:
        return None
    return getattr(precision, 'reduce_dtype', None) or getattr(precision, 'param_dtype', None)


def trace_for(wrapper_cls: type, wrapper_cfg: Mapping[str, Any], model: nn.Module,
              batch: Any, world_size: int = 1, autocast: Optional[torch.dtype] = None) -> Any:
    """Trace one training step of ``model`` under a ``model_wrapper_cfg`` (see :func:`trace_of`)."""
    wrapping = _wrapping(wrapper_cls, wrapper_cfg)
    return trace_of(wrapping, wrapping.layout(model), model, batch, world_size, autocast)


def trace_of(wrapping: Wrapping, layout: Layout, model: nn.Module, batch: Any,
             world_size: int = 1, autocast: Optional[torch.dtype] = None) -> Any:
    """Trace one training step of ``model`` as the resolved config and its layout compute it.

    Honours ``activation_checkpointing`` (each mode), the mixed-precision
    ``param_dtype`` and the optim wrapper's AMP (``autocast``: its dtype, from
    :func:`mmfsdp.amp.autocast_dtype`), and attributes activations to the wrap policy's units.
    ``mode='memory_budget'`` is not traced (the compiler's partitioner decides
    what it keeps): torch defines the budget as the fraction of the activations
    between recomputing the compiled layers entirely (0) and keeping all they
    save (1), and the plan interpolates between those two traces.
    """
    from .trace import trace_step
    spec = _spec(wrapping, layout, world_size)
    trace = functools.partial(trace_step, model, batch, units=spec.units,
                              compute_dtype=spec.compute_dtype, fp32_modules=spec.fp32_units,
                              autocast_dtype=autocast)
    checkpointing = layout.checkpointing
    if checkpointing is None or checkpointing.wraps_layers:
        return trace(checkpoint_layers=spec.checkpoint_layers, checkpointing=checkpointing)
    kept, recomputed = trace(), trace(checkpoint_layers=layout.compile_layers)
    budget = checkpointing.memory_budget

    def between(low: int, high: int) -> int:
        return round(low + budget * (high - low))

    return dataclasses.replace(
        recomputed, activation_bytes=between(recomputed.activation_bytes, kept.activation_bytes),
        peak_bytes=between(recomputed.peak_bytes, kept.peak_bytes),
        by_unit={unit: between(recomputed.by_unit.get(unit, 0), kept.by_unit.get(unit, 0))
                 for unit in set(kept.by_unit) | set(recomputed.by_unit)},
        checkpointed=(f'memory_budget={budget:g}', ))


def plan_for(wrapper_cls: type, wrapper_cfg: Mapping[str, Any], model: nn.Module,
             world_size: int, optimizer_cfg: Optional[Mapping[str, Any]] = None,
             ema: bool = False, accumulative_counts: int = 1) -> Plan:
    """The plan of ``model`` under a ``model_wrapper_cfg`` (``ema``: an EMAHook is configured).

    ``accumulative_counts`` is the optim wrapper's: with ``accumulation='unsharded'``
    and more than one micro-step, gradients are planned unsharded. Raises
    ``TypeError`` for a wrapper that is not mmfsdp's.
    """
    wrapping = _wrapping(wrapper_cls, wrapper_cfg)
    return plan_of(wrapping, wrapping.layout(model), model, world_size,
                   dict(optimizer=optimizer_cfg or {}, accumulative_counts=accumulative_counts),
                   ema)


def _spec(wrapping: Wrapping, layout: Optional[Layout], world_size: int) -> ShardingSpec:
    if not wrapping.ours:
        raise TypeError(f'{wrapping.cls.__name__} has no sharding plan; plans are available '
                        "for mmfsdp's wrappers")
    return sharding_spec(wrapping.config, layout, world_size)


def plan_of(wrapping: Wrapping, layout: Optional[Layout], model: nn.Module, world_size: int,
            optim_wrapper_cfg: Mapping[str, Any], ema: bool = False) -> Plan:
    """The plan from a resolved config and its layout: what the runner and the CLI hold.

    ``optim_wrapper_cfg`` is the config's ``optim_wrapper`` (its ``optimizer``
    and ``accumulative_counts``); ``ema``: an ``EMAHook`` is configured.
    Raises ``TypeError`` for a wrapper that is not mmfsdp's.
    """
    optimizer = optim_wrapper_cfg.get('optimizer')
    return make_plan(model, _spec(wrapping, layout, world_size), world_size,
                     optimizer_states_per_param(
                         dict(optimizer) if isinstance(optimizer, Mapping) else {}),
                     ema=ema, accumulative_counts=optim_wrapper_cfg.get('accumulative_counts', 1),
                     reduce_dtype=reduce_dtype_of(wrapping))


def log_sharding_plan(logger: logging.Logger, plan: Plan) -> None:
    """Log ``plan`` (its units and bytes per rank), then each of its warnings."""
    logger.info('Sharding plan:\n' + format_plan(plan, with_warnings=False))
    for warning in plan_warnings(plan):
        logger.warning(f'Sharding plan: {warning}')
