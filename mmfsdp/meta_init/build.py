"""Build a model with only its parameters and buffers on the meta device.

Registration is intercepted rather than setting a global ``torch.device('meta')``,
so every other tensor a constructor makes stays real (``linspace(...)[i].item()``
works). The values construction gave each parameter and buffer are recorded for
:func:`mmfsdp.meta_init.materialize` to write back; docs/meta-init.md has the rules.
"""
import contextlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Tuple, Union

import torch
from mmengine.model import BaseDataPreprocessor
from torch import nn

from ..compat import (
    PRIVATE_INITIALISERS,
    TorchDispatchMode,
    argument_names,
    operator_name,
    replace_registered,
    storage_key,
    written_arguments,
)

__all__ = ['RECORD_LIMIT_BYTES', 'Recorded', 'build_on_meta', 'empty_weights', 'recorded']

#: Constructor values larger than this (per tensor) are not recorded: 16 MiB,
#: ample for tokens, position ids, norms and scales, small beside any shard.
RECORD_LIMIT_BYTES = 16 * 2**20

#: The operators that allocate without writing.
_EMPTY_OPS = {'aten::empty', 'aten::empty_like', 'aten::empty_strided', 'aten::new_empty',
              'aten::new_empty_strided', 'aten::empty_permuted'}

#: Functions whose writes materialisation replays (it runs them again).
_REPLAYED = frozenset({'reset_parameters', *PRIVATE_INITIALISERS, 'init_weights', '_init_weights'})


@dataclass(frozen=True)
class Recorded:
    """What construction left in one parameter or buffer."""

    #: Its value on the CPU, or ``None`` when it had none or was too large.
    value: Optional[torch.Tensor]
    #: Why there is no value: ``'unset'``, ``'too large'`` or ``'written after registration'``.
    missing: Optional[str] = None


#: module -> {tensor name -> Recorded}; weak, so records die with their modules.
_RECORDS: 'weakref.WeakKeyDictionary[nn.Module, Dict[str, Recorded]]' = \
    weakref.WeakKeyDictionary()


def recorded(module: nn.Module) -> Mapping[str, Recorded]:
    """The constructor values recorded for ``module``'s own parameters and buffers."""
    return _RECORDS.get(module, {})


def forget(model: nn.Module) -> None:
    """Drop the records of ``model``'s modules (once restored, they only hold memory)."""
    for module in model.modules():
        _RECORDS.pop(module, None)


def written_values(func: Any, args: tuple, kwargs: dict) -> List[Any]:
    """The arguments an operator writes (in place or through ``out=``)."""
    values = dict(zip(argument_names(func), args), **kwargs)
    return [values.get(name) for name in written_arguments(func)]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.device.type != 'meta' else 0


def _replayed() -> bool:
    frame = inspect.currentframe().f_back.f_back  # the caller's caller
    while frame is not None:
        if frame.f_code.co_name in _REPLAYED:
            return True
        frame = frame.f_back
    return False


class _ConstructionWatch(TorchDispatchMode):
    """Sees every operator of a constructor.

    Remembers storages allocated empty until something writes them, and marks a
    parameter / buffer already on meta as lost when written from anywhere but an
    initialiser that materialisation replays.
    """

    def __init__(self) -> None:
        super().__init__()
        self.unset: Set[int] = set()
        #: meta storage -> (module, tensor name) of registered parameters and buffers
        self.registered: Dict[int, Tuple[weakref.ref[nn.Module], str]] = {}

    def watch(self, module: nn.Module, name: str, meta: torch.Tensor) -> None:
        self.registered[storage_key(meta)] = (weakref.ref(module), name)

    def _wrote_meta(self, tensor: torch.Tensor) -> None:
        owner = self.registered.get(storage_key(tensor))
        module = owner[0]() if owner else None
        if module is not None and not _replayed():
            _RECORDS.setdefault(module, {})[owner[1]] = Recorded(None, 'written after registration')

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        for value in written_values(func, args, kwargs):
            if isinstance(value, torch.Tensor):
                if value.is_meta:
                    self._wrote_meta(value)
                else:
                    self.unset.discard(_storage_key(value))
        for result in out if isinstance(out, (tuple, list)) else (out, ):
            if isinstance(result, torch.Tensor) and result.numel():
                key = _storage_key(result)
                if operator_name(func) in _EMPTY_OPS:
                    self.unset.add(key)
                else:  # a fresh result, or a storage reused after a free
                    self.unset.discard(key)
        return out


def _record(module: nn.Module, name: str, tensor: torch.Tensor, watch: _ConstructionWatch) -> None:
    if tensor.numel() and _storage_key(tensor) in watch.unset:
        entry = Recorded(None, 'unset')
    elif tensor.numel() * tensor.element_size() > RECORD_LIMIT_BYTES:
        entry = Recorded(None, 'too large')
    else:
        entry = Recorded(tensor.detach().to('cpu', copy=True))
    _RECORDS.setdefault(module, {})[name] = entry


def _meta_parameter(param: nn.Parameter) -> nn.Parameter:
    meta = type(param)(param.detach().to('meta'), requires_grad=param.requires_grad)
    meta.__dict__.update(param.__dict__)
    return meta


#: Modules whose parameters and buffers :func:`empty_weights` leaves real.
KEPT_REAL = (BaseDataPreprocessor, )


@contextlib.contextmanager
def empty_weights(record: bool = True) -> Iterator[None]:
    """Inside, registered parameters and buffers go to the meta device.

    Those of a data preprocessor (:data:`KEPT_REAL`) stay real: it is small,
    its buffers (``mean`` / ``std``) are what its constructor computes, and the
    model may build it itself from a config without ``type`` (mmpretrain's
    classifiers default it). It moves to the training device with the model.

    With ``record``, their constructor values are kept; the plan's dry run needs
    shapes only and passes ``False``.
    """
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer
    watch = _ConstructionWatch()

    def to_meta(module: nn.Module, name: str, tensor: torch.Tensor,
                make_meta: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if record:
            _record(module, name, tensor, watch)
        meta = make_meta(tensor)
        replace_registered(module, name, meta)
        watch.watch(module, name, meta)

    def to_meta_parameter(module: nn.Module, name: str,
                          param: Optional[nn.Parameter]) -> None:
        register_parameter(module, name, param)
        if (param is not None and not param.is_meta and not isinstance(module, KEPT_REAL)
                and not isinstance(param, nn.parameter.UninitializedParameter)):
            to_meta(module, name, param, _meta_parameter)

    def to_meta_buffer(module: nn.Module, name: str, tensor: Optional[torch.Tensor],
                       persistent: bool = True) -> None:
        register_buffer(module, name, tensor, persistent)
        if (tensor is not None and not tensor.is_meta and not isinstance(module, KEPT_REAL)
                and not isinstance(tensor, nn.parameter.UninitializedBuffer)):
            to_meta(module, name, tensor, lambda t: t.detach().to('meta'))

    nn.Module.register_parameter = to_meta_parameter
    nn.Module.register_buffer = to_meta_buffer
    try:
        with watch if record else contextlib.nullcontext():
            yield
    finally:
        nn.Module.register_parameter = register_parameter
        nn.Module.register_buffer = register_buffer


def build_on_meta(build: Callable[[Any], nn.Module],
                  model: Union[nn.Module, Mapping]) -> nn.Module:
    """``build(model)`` under :func:`empty_weights` (the data preprocessor stays real)."""
    if isinstance(model, nn.Module):
        raise TypeError("model_wrapper_cfg.init_device: 'meta' needs the model as a config "
                        'dict; a model passed as an nn.Module is already built')
    with empty_weights():
        return build(model)
