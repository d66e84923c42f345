"""From ``model_wrapper_cfg`` to a built wrapper: resolve once, walk once, build.

:func:`resolve_wrapper` finds the class the config names (as mmengine's
``MODEL_WRAPPERS.build`` would: in the dict's ``_scope_`` or the config's
``default_scope``) and resolves its options into the wrapper's typed config,
once per process. :meth:`Wrapping.layout` walks the model once (its
:class:`~mmfsdp.policies.ModelIndex`); the rank agreement, the plan and
:meth:`Wrapping.build` all take that layout.

mmengine's FSDP wrapper is refused with the name to write instead. Other
wrappers (mmengine's DDP, third-party ones) have their keywords checked and are
built as mmengine builds them.
"""
import dataclasses
import inspect
from typing import Any, Dict, Mapping, Optional

import torch
from mmengine.config.lazy import LazyAttr, LazyObject
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from ..names import note_checkpoint_keys
from ..options import check_keys, suggest
from ..policies import ModelIndex
from ..registry import MODEL_WRAPPERS
from ..strategies import translate_strategy
from .base import Layout, ParallelWrapper, WrapperConfig

#: Used when ``model_wrapper_cfg`` is not set, as mmengine uses its DDP.
DEFAULT_WRAPPER = 'mmfsdp.MMDistributedDataParallel'

_INSTEAD = ("type='mmfsdp.MMFullyShardedDataParallel' (FSDP1) or type='mmfsdp.MMFullyShard' "
            '(FSDP2), with the options in the README')


def model_wrapper_config(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of the config's ``model_wrapper_cfg``, with mmengine's defaults.

    Unset: :data:`DEFAULT_WRAPPER` with the config's ``find_unused_parameters``;
    without ``type``: its keys are options of that default wrapper, as in mmengine.
    A FlexibleRunner ``strategy`` gives its translation (:mod:`mmfsdp.strategies`).
    The classes and functions a Python-style config imports are built at any depth
    (mmengine builds only those its ``ConfigDict`` hands out, not those in a list or set:
    ``layer_cls=[Block]``).
    """
    wrapper_cfg = translate_strategy(cfg).model_wrapper_cfg or cfg.get('model_wrapper_cfg')
    if wrapper_cfg is None:
        return dict(type=DEFAULT_WRAPPER,
                    find_unused_parameters=cfg.get('find_unused_parameters', False))
    return _built(wrapper_cfg if 'type' in wrapper_cfg else
                  dict(type=DEFAULT_WRAPPER, **wrapper_cfg))


def _built(value: Any) -> Any:
    """``value`` as plain dicts, lists, tuples and sets, its lazily imported names built."""
    if isinstance(value, (LazyObject, LazyAttr)):
        return value.build()
    if isinstance(value, Mapping):
        return {k: _built(v) for k, v in value.items()}
    if type(value) in (list, tuple, set, frozenset):
        return type(value)(_built(v) for v in value)
    return value


@dataclasses.dataclass(frozen=True)
class Wrapping:
    """A ``model_wrapper_cfg``, resolved: the class, its options as written, its typed config.

    For wrappers that are not mmfsdp's, ``config`` is :class:`WrapperConfig`'s
    defaults (no offload, no meta init, no staging) and there is no layout.
    """

    cls: type
    options: Mapping[str, Any]
    config: WrapperConfig = WrapperConfig()

    @property
    def ours(self) -> bool:
        """Whether the wrapper is one of mmfsdp's (it then has a layout and a plan)."""
        return issubclass(self.cls, ParallelWrapper)

    @property
    def meta_init(self) -> bool:
        """Whether the model is to be built on the meta device and wrapped at once."""
        return self.ours and self.cls.supports_meta_init and self.config.init_device == 'meta'

    def layout(self, module: nn.Module) -> Optional[Layout]:
        """Check the config against ``module`` and walk it into units (``None``: not ours)."""
        return self.config.layout(ModelIndex(module)) if self.ours else None

    def build(self, module: nn.Module, layout: Optional[Layout], device: torch.device,
              sync_module_states: bool = False) -> nn.Module:
        """The wrapper around ``module`` (the wrapper class picks its form: ``cls.wrap``).

        ``sync_module_states``: the model stayed on the CPU until now, and the
        wrapper broadcasts rank 0's weights unit by unit on the device.
        """
        if not self.ours:
            args: Dict[str, Any] = dict(module=module)
            if issubclass(self.cls, DistributedDataParallel):  # the stock Runner's device_ids
                args['device_ids'] = None if device.type == 'cpu' else [device.index]
            return MMENGINE_MODEL_WRAPPERS.build(dict(self.options, type=self.cls),
                                                 default_args=args)
        note_checkpoint_keys(module)
        config = self.config
        if sync_module_states:
            config = dataclasses.replace(config, sync_module_states=True)
        return self.cls.wrap(module, config, layout)


def resolve_wrapper(wrapper_cfg: Mapping[str, Any],
                    default_scope: Optional[str] = None) -> Wrapping:
    """Resolve a ``model_wrapper_cfg`` (with ``type``) once: class, options, typed config.

    Raises on an unknown wrapper (``KeyError``, listing the registered ones;
    ``ValueError`` for mmengine's FSDP wrapper), an unknown keyword or a bad
    value, naming the key, the value and the choices; the same on every rank,
    before any collective.
    """
    name = wrapper_cfg.get('type')
    cls = name
    if not isinstance(name, type):  # looked up as mmengine's MODEL_WRAPPERS.build does
        with MMENGINE_MODEL_WRAPPERS.switch_scope_and_registry(
                wrapper_cfg.get('_scope_') or default_scope) as registry:
            cls = registry.get(name)
    if cls is None:
        MODEL_WRAPPERS.import_from_location()
        names = sorted(MMENGINE_MODEL_WRAPPERS.module_dict) + sorted(
            f'{MODEL_WRAPPERS.scope}.{n}' for n in MODEL_WRAPPERS.module_dict)
        raise KeyError(f'model_wrapper_cfg.type: {name!r} is not a registered model wrapper'
                       f'{suggest(name, names)}; registered wrappers are {names}')
    if issubclass(cls, FullyShardedDataParallel) and cls.__module__.startswith('mmengine.'):
        raise ValueError(f"model_wrapper_cfg.type: {name!r} is mmengine's FSDP wrapper "
                         f'({cls.__module__}.{cls.__name__}), which mmfsdp.FSDPRunner does not '
                         f'use; write {_INSTEAD}')
    options = {k: v for k, v in wrapper_cfg.items() if k not in ('type', '_scope_')}
    if issubclass(cls, ParallelWrapper):
        return Wrapping(cls, options, cls.CONFIG.from_dict(options))
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        check_keys(options, [n for n in params if n not in ('self', 'module')],
                   'model_wrapper_cfg')
    return Wrapping(cls, options)
