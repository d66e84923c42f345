"""Know before you launch: the sharding plan of a model and its memory per rank.

- :mod:`.spec`: what a wrapper will do (its ``sharding_spec`` classmethod);
- :mod:`.memory`: bytes per rank of parameters, gradients, optimizer state;
- :mod:`.report`: the table, the JSON object and the warnings;
- ``python -m mmfsdp.plan CONFIG --world-size 1 8 64``: a dry run on the meta device.
"""
from typing import Any, Mapping, Optional

from torch import nn

from ..options import wrapper_options
from ..protocol import is_parallel_wrapper
from .memory import Plan, Unit, make_plan, optimizer_states_per_param
from .report import format_plan, plan_to_dict, plan_warnings
from .spec import Construction, Padding, ShardingSpec

__all__ = ['Construction', 'Padding', 'Plan', 'ShardingSpec', 'Unit', 'format_plan', 'make_plan',
           'optimizer_states_per_param', 'plan_for', 'plan_to_dict', 'plan_warnings']


def plan_for(wrapper_cls: type, wrapper_cfg: Mapping[str, Any], model: nn.Module,
             world_size: int, optimizer_cfg: Optional[Mapping[str, Any]] = None,
             ema: bool = False) -> Plan:
    """The plan of ``model`` under a ``model_wrapper_cfg`` (``ema``: an EMAHook is configured).

    Raises ``TypeError`` if the wrapper cannot describe its sharding (only
    mmfsdp's wrappers can).
    """
    if not is_parallel_wrapper(wrapper_cls):
        raise TypeError(f'{wrapper_cls.__name__} has no sharding_spec(); plans are available for '
                        "mmfsdp's wrappers")
    options = wrapper_options(wrapper_cfg)
    spec = wrapper_cls.sharding_spec(options, model, world_size)
    return make_plan(model, spec, world_size,
                     optimizer_states_per_param(dict(optimizer_cfg or {})), ema=ema)
