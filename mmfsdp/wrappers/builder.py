"""Find and check a ``model_wrapper_cfg`` before anything is built, and how it is built.

The wrapper class is looked up as mmengine's ``MODEL_WRAPPERS.build`` would:
in the registry of the dict's ``_scope_`` (which mmengine adds when a config
inherits ours through ``mmfsdp::``) or else of the config's ``default_scope``.
So ``type='MMFullyShardedDataParallel'`` means mmfsdp's wrapper in the
``mmfsdp`` scope and mmengine's anywhere else. mmengine's FSDP wrapper is
refused, with the name to write instead: ``FSDPRunner`` shards with mmfsdp's
wrappers only, and mmengine's takes other options and needs an accelerator.
mmengine's DDP wrapper is accepted: under ``FSDPRunner`` it trains like
``mmfsdp.MMDistributedDataParallel``.

:class:`mmfsdp.FSDPRunner` takes from here the config with mmengine's defaults
(:func:`model_wrapper_config`), whether the model waits on the CPU for the
wrapper (:func:`stages_on_cpu`), and the arguments it adds when it builds the
wrapper (:func:`build_args`).
"""
import inspect
from typing import Any, Dict, Mapping, Optional

import torch
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from ..options import check_keys, suggest, wrapper_options
from ..protocol import is_parallel_wrapper
from ..registry import MODEL_WRAPPERS
from .ddp import MMDistributedDataParallel
from .steps import own_steps

__all__ = ['DEFAULT_WRAPPER', 'build_args', 'check_wrapper_config', 'model_wrapper_config',
           'offloads_to_cpu', 'registered_wrapper_names', 'resolve_wrapper_type', 'stages_on_cpu']

#: Used when ``model_wrapper_cfg`` is not set, as mmengine uses its DDP.
DEFAULT_WRAPPER = 'mmfsdp.MMDistributedDataParallel'

#: What to write instead of a wrapper of mmengine that FSDPRunner cannot drive.
_INSTEAD = ("type='mmfsdp.MMFullyShardedDataParallel' (FSDP1) or type='mmfsdp.MMFullyShard' "
            '(FSDP2), with the options in the README')


def model_wrapper_config(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of the config's ``model_wrapper_cfg``, with mmengine's defaults.

    Unset: :data:`DEFAULT_WRAPPER` with the config's ``find_unused_parameters``;
    without ``type``: its keys are options of that default wrapper, as in mmengine.
    """
    wrapper_cfg = cfg.get('model_wrapper_cfg')
    if wrapper_cfg is None:
        return dict(type=DEFAULT_WRAPPER,
                    find_unused_parameters=cfg.get('find_unused_parameters', False))
    if 'type' not in wrapper_cfg:
        return dict(type=DEFAULT_WRAPPER, **wrapper_cfg)
    return dict(wrapper_cfg)


def registered_wrapper_names() -> list:
    """Every wrapper name a config can use: mmengine's and ``'mmfsdp.<Name>'``."""
    MODEL_WRAPPERS.import_from_location()
    return sorted(MMENGINE_MODEL_WRAPPERS.module_dict) + sorted(
        f'{MODEL_WRAPPERS.scope}.{n}' for n in MODEL_WRAPPERS.module_dict)


def resolve_wrapper_type(cfg: Mapping[str, Any], default_scope: Optional[str] = None) -> type:
    """The class ``cfg['type']`` names, looked up as mmengine's ``MODEL_WRAPPERS.build`` does.

    Args:
        cfg: The ``model_wrapper_cfg``; its ``_scope_``, if any, picks the registry.
        default_scope: The config's ``default_scope``, used without ``_scope_``
            (``None``: the scope mmengine holds current).

    Raises ``KeyError`` for an unknown name and ``ValueError`` for mmengine's
    FSDP wrapper.

    """
    name = cfg.get('type')
    if isinstance(name, type):
        cls = name
    else:
        with MMENGINE_MODEL_WRAPPERS.switch_scope_and_registry(
                cfg.get('_scope_') or default_scope) as registry:
            cls = registry.get(name)
    if cls is None:
        names = registered_wrapper_names()
        raise KeyError(f'model_wrapper_cfg.type: {name!r} is not a registered model wrapper'
                       f'{suggest(name, names)}; registered wrappers are {names}')
    if issubclass(cls, FullyShardedDataParallel) and cls.__module__.startswith('mmengine.'):
        raise ValueError(f"model_wrapper_cfg.type: {name!r} is mmengine's FSDP wrapper "
                         f'({cls.__module__}.{cls.__name__}), which mmfsdp.FSDPRunner does not '
                         f'use; write {_INSTEAD}')
    return cls


def check_wrapper_config(cls: type, cfg: Mapping[str, Any],
                         module: Optional[nn.Module] = None) -> None:
    """Raise on keywords ``cls`` does not take and, for mmfsdp wrappers, on bad values.

    ``type`` and ``_scope_`` are not keywords of the wrapper. With ``module``,
    options checked against the model (wrap policies, layer classes) are
    checked too.
    """
    options = wrapper_options(cfg)
    if is_parallel_wrapper(cls):
        cls.check_config(options, module)
        return
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        check_keys(options, [n for n in params if n not in ('self', 'module')],
                   'model_wrapper_cfg')


def offloads_to_cpu(cls: type, cfg: Mapping[str, Any]) -> bool:
    """Whether the wrapper ``cls`` with ``cfg`` keeps parameters on the CPU while training.

    mmfsdp's wrappers tell (:meth:`~mmfsdp.protocol.ParallelWrapper.offloads_to_cpu`);
    others never offload.
    """
    return is_parallel_wrapper(cls) and bool(cls.offloads_to_cpu(wrapper_options(cfg)))


def build_args(cls: type, module: nn.Module, device: torch.device,
               sync_module_states: bool) -> Dict[str, Any]:
    """The ``default_args`` with which ``FSDPRunner`` builds wrapper ``cls`` around ``module``.

    mmengine's DDP gets the stock Runner's ``device_ids``, ``None`` on the CPU
    (DDP rejects device ids for CPU modules). ``sync_module_states``: the
    model stayed on the CPU until wrapping (staged FSDP1), so the wrapper
    broadcasts rank 0's weights unit by unit on the device.
    """
    args: Dict[str, Any] = dict(module=module)
    if issubclass(cls, DistributedDataParallel) and not issubclass(cls, MMDistributedDataParallel):
        args['device_ids'] = None if device.type == 'cpu' else [device.index]
    if sync_module_states:
        args['sync_module_states'] = True
    return args


def stages_on_cpu(cls: type, cfg: Mapping[str, Any], module: nn.Module,
                  device: torch.device) -> bool:
    """Whether ``module`` stays on the CPU until wrapper ``cls`` moves it unit by unit.

    As the wrapper says (:meth:`mmfsdp.protocol.ParallelWrapper.stages_on_cpu`);
    not for a model with its own steps (FSDP1 wraps its children separately).
    """
    return (is_parallel_wrapper(cls) and cls.stages_on_cpu(cfg, device)
            and not own_steps(module))
