"""Build a model with its parameters and buffers on the meta device, nothing else.

:func:`empty_weights` intercepts ``nn.Module.register_parameter`` and
``register_buffer``: each tensor is registered as usual, then replaced by a
meta tensor of the same shape and dtype. Every other tensor a constructor
makes stays real, so ``torch.linspace(0, rate, depth)[i].item()`` works (a
global ``torch.device('meta')`` would make it a meta tensor and ``.item()``
would fail).

Constructor-set values are recorded at registration: a parameter or buffer
made by ``torch.zeros`` / ``ones`` / ``arange`` / ``full`` / arithmetic
(``cls_token``, ``position_ids``, LayerScale's ``gamma``) is copied to the CPU
before it goes to meta, up to :data:`RECORD_LIMIT_BYTES` per tensor, and
:func:`mmfsdp.meta_init.materialize` writes it back onto the shards. A tensor
allocated by ``torch.empty`` and not written before registration holds no value
and is not recorded (an initialiser must write it); nor is one the constructor
writes into after registering it (the write went to meta and is lost), unless
the write came from ``reset_parameters`` / ``_reset_parameters`` /
``init_weights``, which materialisation runs again. Which storages are still
uninitialised is tracked by a dispatch mode that sees every operator of the
constructor.
"""
import contextlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Set, Tuple, Union

import torch
from mmengine.registry import MODELS
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


@dataclass(frozen=True)
class Recorded:
    """What construction left in one parameter or buffer."""

    #: Its value on the CPU, or ``None`` when it had none or was too large.
    value: Optional[torch.Tensor]
    #: Why there is no value: ``'unset'`` (``torch.empty``, never written),
    #: ``'too large'`` (over :data:`RECORD_LIMIT_BYTES`) or ``'written after
    #: registration'`` (the constructor wrote into it once it was on meta, other
    #: than through ``reset_parameters`` / ``init_weights``, which are replayed).
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


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.device.type != 'meta' else 0


#: Functions whose writes materialisation replays (``reset_parameters`` and
#: ``init_weights`` run again there).
_REPLAYED = frozenset({'reset_parameters', *PRIVATE_INITIALISERS, 'init_weights', '_init_weights'})


def _replayed() -> bool:
    frame = inspect.currentframe().f_back.f_back  # the caller's caller
    while frame is not None:
        if frame.f_code.co_name in _REPLAYED:
            return True
        frame = frame.f_back
    return False


class _ConstructionWatch(TorchDispatchMode):
    """Sees every operator of a constructor.

    Remembers storages allocated empty until an operator writes to them, and
    notices writes into parameters / buffers already on meta from anywhere but
    an initialiser that materialisation replays: such a value is lost.
    """

    def __init__(self) -> None:
        super().__init__()
        self.unset: Set[int] = set()
        #: meta storage -> (module, tensor name) of registered parameters and buffers
        self.registered: Dict[int, Tuple[weakref.ref[nn.Module], str]] = {}

    def watch(self, module: nn.Module, name: str, meta: torch.Tensor) -> None:
        """Report writes into ``meta``, registered as ``module.<name>``."""
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
        written = written_arguments(func)
        values = dict(zip(argument_names(func), args), **kwargs)
        for name in written:
            value = values.get(name)
            if isinstance(value, torch.Tensor):
                if value.is_meta:
                    self._wrote_meta(value)
                else:
                    self.unset.discard(_storage_key(value))
        results = out if isinstance(out, (tuple, list)) else (out, )
        for result in results:
            if isinstance(result, torch.Tensor) and result.numel():
                key = _storage_key(result)
                if operator_name(func) in _EMPTY_OPS:
                    self.unset.add(key)
                else:  # a fresh result, or a storage reused after a free
                    self.unset.discard(key)
        return out


def _record(module: nn.Module, name: str, tensor: torch.Tensor,
            unset: _ConstructionWatch, keep: bool) -> None:
    if not keep:
        return
    if tensor.numel() and _storage_key(tensor) in unset.unset:
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


@contextlib.contextmanager
def empty_weights(record: bool = True) -> Iterator[None]:
    """Inside, registered parameters and buffers go to the meta device.

    With ``record``, their constructor values are kept (see the module
    docstring); the plan's dry run needs shapes only and passes ``False``.
    """
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer
    unset = _ConstructionWatch()

    def to_meta_parameter(module: nn.Module, name: str,
                          param: Optional[nn.Parameter]) -> None:
        register_parameter(module, name, param)
        if (param is not None and not param.is_meta
                and not isinstance(param, nn.parameter.UninitializedParameter)):
            _record(module, name, param, unset, record)
            meta = _meta_parameter(param)
            replace_registered(module, name, meta)
            unset.watch(module, name, meta)

    def to_meta_buffer(module: nn.Module, name: str, tensor: Optional[torch.Tensor],
                       persistent: bool = True) -> None:
        register_buffer(module, name, tensor, persistent)
        if (tensor is not None and not tensor.is_meta
                and not isinstance(tensor, nn.parameter.UninitializedBuffer)):
            _record(module, name, tensor, unset, record)
            meta = tensor.detach().to('meta')
            replace_registered(module, name, meta)
            unset.watch(module, name, meta)

    nn.Module.register_parameter = to_meta_parameter
    nn.Module.register_buffer = to_meta_buffer
    try:
        with unset if record else contextlib.nullcontext():
            yield
    finally:
        nn.Module.register_parameter = register_parameter
        nn.Module.register_buffer = register_buffer


def build_on_meta(build: Callable[[Any], nn.Module],
                  model: Union[nn.Module, Mapping]) -> nn.Module:
    """``build(model)`` under :func:`empty_weights`, its data preprocessor built for real.

    The data preprocessor is small and its buffers (``mean`` / ``std``) are
    what its constructor computes; it stays a real module on the CPU and moves
    to the training device with the model.
    """
    if isinstance(model, nn.Module):
        raise TypeError("model_wrapper_cfg.init_device: 'meta' needs the model as a config "
                        'dict; a model passed as an nn.Module is already built')
    model = dict(model)
    preprocessor = model.get('data_preprocessor')
    if isinstance(preprocessor, Mapping):
        model['data_preprocessor'] = MODELS.build(preprocessor)
    with empty_weights():
        return build(model)
