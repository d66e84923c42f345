"""Know before you launch: the sharding plan of a model and its memory per rank.

- :mod:`.spec`: what a wrapper will do (its ``sharding_spec`` classmethod);
- :mod:`.memory`: bytes per rank of parameters, gradients, optimizer state;
- :mod:`.report`: the table, the JSON object and the warnings;
- :mod:`.trace`, :mod:`.batch`, :mod:`.step`: activations of one training step
  traced with fake tensors, and the step's peak per rank;
- :mod:`.host`: what a CPU host keeps resident beyond the live tensors;
- :mod:`.fit`: the configurations whose peak fits a memory budget;
- ``python -m mmfsdp.plan CONFIG --world-size 1 8 64``: a dry run on the meta device.
"""
import logging
from typing import Any, Mapping, Optional

from torch import nn

from ..options import wrapper_options
from ..protocol import is_parallel_wrapper
from .host import heap_threshold
from .memory import Plan, Unit, make_plan, optimizer_states_per_param
from .report import format_plan, plan_to_dict, plan_warnings
from .spec import Construction, Padding, ShardingSpec
from .step import StepPeak, step_peak
from .trace import BatchFn, StepTrace, trace_step

__all__ = ['BatchFn', 'Construction', 'Padding', 'Plan', 'ShardingSpec', 'StepPeak', 'StepTrace',
           'Unit', 'format_plan', 'heap_threshold', 'log_sharding_plan', 'make_plan',
           'optimizer_states_per_param',
           'plan_for', 'plan_to_dict', 'plan_warnings', 'step_peak', 'trace_for', 'trace_step']


def _describe(wrapper_cls: type, wrapper_cfg: Mapping[str, Any], model: nn.Module,
              world_size: int) -> ShardingSpec:
    if not is_parallel_wrapper(wrapper_cls):
        raise TypeError(f'{wrapper_cls.__name__} has no sharding_spec(); plans are available for '
                        "mmfsdp's wrappers")
    return wrapper_cls.sharding_spec(wrapper_options(wrapper_cfg), model, world_size)


def trace_for(wrapper_cls: type, wrapper_cfg: Mapping[str, Any], model: nn.Module,
              batch: BatchFn, world_size: int = 1) -> StepTrace:
    """Trace one training step of ``model`` as the wrapper config computes it.

    Honours the config's ``activation_checkpointing`` and mixed-precision
    ``param_dtype``, and attributes activations to the wrap policy's units.
    ``world_size`` only has to be one the config accepts (a fixed ``mesh``).
    """
    spec = _describe(wrapper_cls, wrapper_cfg, model, world_size)
    return trace_step(model, batch, units=spec.units, checkpoint_layers=spec.checkpoint_layers,
                      compute_dtype=spec.compute_dtype)


def plan_for(wrapper_cls: type, wrapper_cfg: Mapping[str, Any], model: nn.Module,
             world_size: int, optimizer_cfg: Optional[Mapping[str, Any]] = None,
             ema: bool = False, accumulative_counts: int = 1) -> Plan:
    """The plan of ``model`` under a ``model_wrapper_cfg`` (``ema``: an EMAHook is configured).

    ``accumulative_counts`` is the optim wrapper's: with ``accumulation='unsharded'``
    and more than one micro-step, gradients are planned unsharded.

    Raises ``TypeError`` if the wrapper cannot describe its sharding (only
    mmfsdp's wrappers can).
    """
    spec = _describe(wrapper_cls, wrapper_cfg, model, world_size)
    return make_plan(model, spec, world_size,
                     optimizer_states_per_param(dict(optimizer_cfg or {})), ema=ema,
                     accumulative_counts=accumulative_counts)


def log_sharding_plan(logger: logging.Logger, wrapper_cls: type, wrapper_cfg: Mapping[str, Any],
                      model: nn.Module, world_size: int, optim_wrapper_cfg: Mapping[str, Any],
                      ema: bool) -> None:
    """Log the plan of ``model`` (its units and bytes per rank), then each of its warnings.

    ``optim_wrapper_cfg`` is the config's ``optim_wrapper``: its ``optimizer``
    (when a dict) sizes the optimizer state, its ``accumulative_counts`` the
    gradients; ``ema``: an EMAHook is configured. :class:`mmfsdp.FSDPRunner`
    calls this on rank 0 before wrapping.
    """
    optimizer = optim_wrapper_cfg.get('optimizer')
    plan = plan_for(wrapper_cls, wrapper_cfg, model, world_size,
                    optimizer if isinstance(optimizer, Mapping) else None, ema=ema,
                    accumulative_counts=optim_wrapper_cfg.get('accumulative_counts', 1))
    logger.info('Sharding plan:\n' + format_plan(plan, with_warnings=False))
    for warning in plan_warnings(plan):
        logger.warning(f'Sharding plan: {warning}')
