"""Activation memory of one training step, traced with fake tensors (no memory, any device).

The model's forward and backward run under ``FakeTensorMode`` while a dispatch
mode follows every storage: the activations alive when forward ends (per unit)
and the peak of forward + backward. A method that needs tensor values (a loss
or an assigner: ``nonzero``, ``.item()``, boolean masks) runs on real CPU
tensors inside the trace, counted alike (:class:`_RealPart`). What the wrapper
does with parameters and gradients is added by :mod:`.step` from the plan
(``docs/plan.md``).
"""
import contextlib
import copy
import inspect
import itertools
import os
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Type

import torch
from torch import nn

from ..checkpointing import ActivationCheckpointing, apply_activation_checkpointing_to
from ..compat import (
    TorchDispatchMode,
    dispatch_modes_off,
    fake_tensor_mode,
    is_fake,
    replace_registered,
    storage_key,
)
from ..tensors import map_tensors as _map_tensors
from ..tensors import tensors as _tensors
from ..wrappers.fsdp2 import compute_in_fp32
from .report import size_text as _size

__all__ = ['StepTrace', 'trace_step']

#: Makes the training batch inside the trace: ``(model) -> (args, kwargs)`` of a
#: call whose result holds the loss (see :mod:`.batch`).
BatchFn = Callable[[nn.Module], Tuple[tuple, Dict[str, Any]]]
#: At most this many methods of one step run on real tensors (each found by one more trace).
MAX_REAL_PARTS = 8
TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class StepTrace:
    """Bytes beyond the parameters during one traced training step (one rank's batch)."""

    #: Alive when forward ends: what backward needs (activations), plus the loss.
    activation_bytes: int
    #: The most alive at any moment of forward + backward.
    peak_bytes: int
    #: ``activation_bytes`` by the unit whose forward allocated them (``''``: the root).
    by_unit: Mapping[str, int]
    #: Layer classes that were checkpointed (recomputed in backward).
    checkpointed: Tuple[str, ...]
    #: dtype the parameters computed in (mixed precision).
    compute_dtype: torch.dtype
    #: The size of every storage in ``activation_bytes``, largest first: where a
    #: host allocator puts them depends on their size (:mod:`.host`).
    activation_sizes: Tuple[int, ...] = ()
    #: The methods that ran on real CPU tensors, measured rather than traced, each
    #: with what needed values: ``'head.loss (DynamicOutputShapeException: ...)'``.
    real_parts: Tuple[str, ...] = ()
    #: dtype the forward ran under ``torch.autocast`` in (``AmpOptimWrapper``), or ``None``.
    autocast_dtype: Optional[torch.dtype] = None

    def activation_bytes_below(self, threshold: int) -> int:
        """Bytes of the activations held in storages smaller than ``threshold`` bytes."""
        return sum(n for n in self.activation_sizes if n < threshold)

    @property
    def transient_bytes(self) -> int:
        """How far the peak rises above the activations (gradients, recomputation)."""
        return self.peak_bytes - self.activation_bytes


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops create, while they live, by current unit."""

    def __init__(self, limit: Optional[int] = None) -> None:
        super().__init__()
        self.live: Dict[int, Tuple[int, str]] = {}
        self.current = self.peak = 0
        self.unit_stack: List[str] = ['']
        self.limit = limit  # bytes; beyond them a step on real tensors stops
        self.owner: Optional[_LiveBytes] = None  # the count that adopted these storages

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, (0, ''))[0]
        if self.owner is not None:
            self.owner._free(key)

    def adopt(self, other: '_LiveBytes', skip: set) -> None:
        """Count ``other``'s live storages (but ``skip``) here too, until they are freed."""
        other.owner = self
        for key, (nbytes, _) in other.live.items():
            if key not in skip:
                self.live[key] = (nbytes, self.unit_stack[-1])
                self.current += nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view, or an in-place op, returns storage it was given: not a new allocation.
        given = {storage_key(t) for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            storage, key = tensor.untyped_storage(), storage_key(tensor)
            if key not in given and key not in self.live:
                self.live[key] = (storage.nbytes(), self.unit_stack[-1])
                self.current += storage.nbytes()
                weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        if self.limit is not None and self.current > self.limit:
            raise MemoryError(f'more than {_size(self.limit)} allocated')
        return out


def _made(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]
          ) -> Dict[int, torch.Tensor]:
    """``make(t)`` (a parameter for a parameter) by ``id(t)``, for ``module``'s tensors.

    As the memo of ``copy.deepcopy(module, memo)`` it copies the module without
    copying a tensor: a real model costs no memory, and no buffer is
    deep-copied inside fake mode (a plain buffer cannot be: fake tensors have
    no ``new_empty``; the copy is made outside it). Tied tensors stay one tensor.
    """
    return {id(t): nn.Parameter(make(t), t.requires_grad) if isinstance(t, nn.Parameter)
            else make(t) for t in itertools.chain(module.parameters(), module.buffers())}


def _loss(output: Any) -> torch.Tensor:
    """The scalar to differentiate: mmengine's ``loss`` entries summed, else every float output."""
    if isinstance(output, Mapping):
        output = [v for k, v in output.items() if 'loss' in k] or list(output.values())
    leaves = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ValueError('the traced step produced no differentiable output to call backward on')
    return sum(t.float().sum() if t.dim() else t.float() for t in leaves)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor for fake ``t``, of its shape, random values (call outside fake mode)."""
    if not is_fake(t):
        return t
    real = (torch.randn if t.is_floating_point() else torch.zeros)(t.shape, dtype=t.dtype)
    return real.requires_grad_(t.requires_grad)


@contextlib.contextmanager
def _raising(make: Callable[[Exception], Exception]) -> Iterator[None]:
    """Raise ``make(error)`` from an error inside; a :class:`RealPartError` passes unchanged."""
    try:
        yield
    except RealPartError:
        raise
    except Exception as error:
        raise make(error) from error


class _Bridge(torch.autograd.Function):
    """Joins a :class:`_RealPart` to the traced graph: its real backward runs in the trace's."""

    @staticmethod
    def forward(ctx: Any, part: '_RealPart', *inputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.part, ctx.inputs = part, [(t.shape, t.dtype) for t in inputs]
        return tuple(torch.empty(t.shape, dtype=t.dtype) for t in part.outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        part, live = ctx.part, ctx.part.live
        with dispatch_modes_off():
            ones = [torch.ones(t.shape, dtype=t.dtype) for t in part.outputs]
            base = live.current - part.real.current  # what the trace holds beside the part
            part.real.peak = part.real.current
            # with the forward's real parameters: a checkpointed layer recomputes with them
            with _raising(part.failed), part.real, part.holding(part.params):
                torch.autograd.backward(part.outputs, ones)
            live.peak = max(live.peak, base + part.real.peak)
            part.outputs, part.params = [], {}  # the real graph goes; its storages leave ``live``
        return (None, *(torch.empty(shape, dtype=dtype) for shape, dtype in ctx.inputs))


class _RealPart:
    """``module.<method>`` run on real CPU tensors inside the trace: its code needs values.

    Fake inputs become real tensors of their shapes (random values; the batch's
    own tensors keep theirs), the module's parameters and buffers too, for the
    call. What the call allocates is counted as the trace counts; what it leaves
    for backward is adopted by the trace's count until it is freed; backward
    through it runs the real backward (:class:`_Bridge`), counted alike.
    """

    def __init__(self, name: str, module: nn.Module, method: str, cause: str, live: _LiveBytes,
                 limit: int) -> None:
        self.name, self.module, self.call = name, module, getattr(module, method)
        self.cause, self.live, self.limit = cause, live, limit
        self.outputs: List[torch.Tensor] = []

    def failed(self, error: Exception) -> 'RealPartError':
        """An error on real tensors is the model's own (or the limit's): say so, do not retry."""
        hint = (f'; such parts run on this host up to {_size(self.limit)} (a quarter of '
                "its memory); --input-shape traces the model in mode='tensor' instead"
                if isinstance(error, MemoryError) else '')
        return RealPartError(f'{self.name} cannot be traced ({self.cause}) and failed on real '
                             f'CPU tensors too: {_cause(error)}{hint}')

    @contextlib.contextmanager
    def holding(self, tensors: Dict[int, torch.Tensor]) -> Iterator[None]:
        """The module holds ``tensors`` (by id of the ones they replace) inside."""
        slots = [(owner, name, t) for owner in self.module.modules() for name, t in [
            *owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]]
        for owner, name, t in slots:
            replace_registered(owner, name, tensors[id(t)])
        try:
            yield
        finally:
            for owner, name, t in slots:
                replace_registered(owner, name, t)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with dispatch_modes_off(), _raising(self.failed):
            # the gradients of fake inputs go back into the trace
            self.inputs = [t for t in _tensors((args, kwargs), objects=True)
                           if is_fake(t) and t.requires_grad]
            args, kwargs = _map_tensors((args, kwargs), _real)
            real = _made(self.module, _real)
            held = sum(t.nbytes for t in real.values())
            if held > self.limit:
                raise MemoryError(f'its parameters take {_size(held)}')
            for p in real.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: setattr(p, 'grad', None))
            self.params, self.real = real, _LiveBytes(self.limit)
            with self.real, self.holding(real):
                out = self.call(*args, **kwargs)
            self.outputs += [t for t in _tensors(out, objects=True) if t.requires_grad]
            self.live.peak = max(self.live.peak, self.live.current + self.real.peak)
            self.live.adopt(self.real, skip={storage_key(t) for t in self.outputs})
        if not self.outputs:
            return out
        dummy = torch.zeros((), requires_grad=True)  # so that backward always comes through
        made = _Bridge.apply(self, dummy, *self.inputs)
        by_id = {id(r): f for r, f in zip(self.outputs, made)}
        return _map_tensors(out, lambda t: by_id.get(id(t), t))


class RealPartError(RuntimeError):
    """A method run on real tensors (:class:`_RealPart`) failed there too."""


class _NeedsValues(Exception):
    """The fake trace stopped (its ``__cause__``) where the model's code needs tensor values."""


def _part_of(error: BaseException, model: nn.Module) -> Tuple[str, str]:
    """``(module name, method)`` to run on real tensors after ``error`` in the fake trace.

    The outermost method of a submodule on the failing call stack (a head's
    ``loss``: its result is only summed into the loss), else the innermost
    method of the model itself (DETR's ``pre_transformer``, which reads the
    feature maps' shapes as a tensor: not the whole forward, backbone included).
    """
    names, part = {id(m): n for n, m in model.named_modules()}, ('', 'forward')
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner, code = frame.f_locals.get('self'), frame.f_code
        method = getattr(type(owner), code.co_name, None) if id(owner) in names else None
        if (callable(method) and getattr(inspect.unwrap(method), '__code__', None) is code
                and not code.co_filename.startswith(TORCH_DIR)):
            if code.co_name.startswith('__'):  # called by the type's __call__: not replaceable
                break  # on the instance, the method calling it is (DINO's pre_decoder)
            if names[id(owner)]:
                return names[id(owner)], code.co_name
            part = '', code.co_name
    return part


def _cause(error: BaseException) -> str:
    """``'Type: message at path:line'``, where the model's own code (not torch's) raised."""
    frames = [(f.f_code.co_filename, line) for f, line in traceback.walk_tb(error.__traceback__)
              if not f.f_code.co_filename.startswith((TORCH_DIR, __file__))]
    where = ''.join(f' at {os.sep.join(path.split(os.sep)[-3:])}:{line}'
                    for path, line in frames[-1:])
    return f'{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ""}{where}'


def trace_step(model: nn.Module, batch: BatchFn, units: Tuple[str, ...] = (),
               checkpoint_layers: Tuple[Type[nn.Module], ...] = (),
               compute_dtype: Optional[torch.dtype] = None,
               fp32_modules: Tuple[str, ...] = (),
               checkpointing: Optional[ActivationCheckpointing] = None,
               real_bytes_limit: Optional[int] = None,
               autocast_dtype: Optional[torch.dtype] = None) -> StepTrace:
    """Trace forward + backward of ``model`` (real or on the meta device; left untouched).

    ``units`` are the wrapper's unit names (:attr:`ShardingSpec.units`);
    ``checkpoint_layers`` the classes wrapped in activation checkpointing, in
    the mode of ``checkpointing`` (full when ``None``);
    ``compute_dtype`` the dtype mixed precision computes in, and
    ``fp32_modules`` the modules that compute in fp32 all the same
    (:attr:`ShardingSpec.fp32_units`); ``autocast_dtype`` the optim wrapper's AMP
    dtype, which the forward runs under as ``optim_context`` runs it.

    Where the model needs tensor values, the method of the submodule around it
    runs on real CPU tensors (see :class:`_RealPart`; found by tracing again,
    at most :data:`MAX_REAL_PARTS` times), up to ``real_bytes_limit`` bytes
    (default: a quarter of this host's memory).
    """
    # The batch is made with real tensors, before fake mode: preprocessing code may
    # branch on values (mmengine's stack_batch on the padding it needs), which fake
    # tensors do not have; the rest of the model is meta. A meta preprocessor tensor (a
    # dry run's model) has no value either: it becomes ones (floats) or zeros, which
    # keeps the batch's shapes and dtypes, all that the trace measures.
    made, pre = _LiveBytes(), getattr(model, 'data_preprocessor', None)
    with made:  # what it allocates, the trace allocates again to count it
        memo = _made(model, lambda t: torch.empty(t.shape, dtype=t.dtype, device='meta'))
        if isinstance(pre, nn.Module):
            memo.update(_made(pre, lambda t: t.detach().clone() if not t.is_meta else (
                torch.ones if t.is_floating_point() else torch.zeros)(t.shape, dtype=t.dtype)))
        args, kwargs = batch(copy.deepcopy(model, memo))
    limit = real_bytes_limit or os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 4
    kept = {id(p) for name in fp32_modules for p in model.get_submodule(name).parameters()}
    parts: Dict[Tuple[str, str], str] = {}  # (module, method) on real tensors: why
    while True:
        # Floating-point parameters take compute_dtype, as mixed precision gathers them,
        # but those of fp32_modules, which compute in fp32 with their inputs cast up and
        # outputs cast back, as the wrappers run them.
        mode, live = fake_tensor_mode(), _LiveBytes()
        with mode:
            tensors = _made(model, lambda t: torch.empty(t.shape, device='cpu', dtype=(
                compute_dtype if compute_dtype is not None and isinstance(t, nn.Parameter)
                and t.is_floating_point() and id(t) not in kept else t.dtype)))
        fake = copy.deepcopy(model, tensors).train()
        for name in fp32_modules if compute_dtype is not None else ():
            compute_in_fp32(fake.get_submodule(name))
        for name in units:  # live.unit_stack: the innermost unit whose forward is running
            module = fake.get_submodule(name)  # (hooks return None: __delitem__, not pop)
            module.register_forward_pre_hook(lambda m, a, n=name, s=live.unit_stack: s.append(n))
            module.register_forward_hook(lambda m, a, o, s=live.unit_stack: s.__delitem__(-1))
        apply_activation_checkpointing_to(fake, tuple(checkpoint_layers), checkpointing)
        for param in fake.parameters():
            # The wrapper takes each gradient as it is accumulated (reduces it into
            # its own buffers, counted by the plan): keep none here. Frozen ones have none.
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda p: setattr(p, 'grad', None))
        for (name, method), cause in parts.items():
            module = fake.get_submodule(name)
            setattr(module, method, _RealPart(f'{name or "(root)"}.{method}', module, method,
                                              cause, live, limit))
        try:
            with mode, live:
                # The step holds its preprocessed batch until it ends: what preprocessing
                # allocated is allocated again; floating inputs are cast to compute_dtype,
                # as mixed precision casts the root's inputs.
                held = _map_tensors((args, kwargs), lambda t: t.clone() if storage_key(
                    t) in made.live else t, objects=False)
                inputs, named = _map_tensors(held, lambda t: t.to(compute_dtype) if (
                    compute_dtype is not None and t.is_floating_point()) else t, objects=False)
                with _raising(_NeedsValues), torch.autocast(
                        'cpu', autocast_dtype, enabled=autocast_dtype is not None):
                    output = fake(*inputs, **named)
                loss = _loss(output)
                del output  # what backward does not need dies here, as in training
                activations, by_unit = live.current, {}
                for nbytes, unit in live.live.values():
                    by_unit[unit] = by_unit.get(unit, 0) + nbytes
                sizes = tuple(sorted((n for n, _ in live.live.values()), reverse=True))
                with _raising(_NeedsValues):
                    loss.backward()
            return StepTrace(activation_bytes=activations, peak_bytes=live.peak, by_unit=by_unit,
                             checkpointed=tuple(c.__name__ for c in checkpoint_layers),
                             compute_dtype=compute_dtype or next(model.parameters()).dtype,
                             activation_sizes=sizes, autocast_dtype=autocast_dtype,
                             real_parts=tuple(f'{name or "(root)"}.{method} ({cause})'
                                              for (name, method), cause in parts.items()))
        except _NeedsValues as need:  # where it needs values, and what it was doing there
            part, cause = _part_of(need.__cause__, fake), _cause(need.__cause__)
            if part in parts or len(parts) == MAX_REAL_PARTS:
                raise RuntimeError(f'the training step cannot be traced: {cause}'
                                   ) from need.__cause__
            parts[part] = cause
            loss = None  # the failed attempt's graph (real parts' tensors) goes before the next
