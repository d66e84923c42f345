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
from ..wrappers.fsdp2 import compute_in_fp32
from .report import size_text as _size

__all__ = ['StepTrace', 'trace_step']

#: Makes the training batch inside the trace: ``(model) -> (args, kwargs)`` of a
#: call whose result holds the loss (see :mod:`.batch`).
BatchFn = Callable[[nn.Module], Tuple[tuple, Dict[str, Any]]]
#: At most this many methods of one step run on real tensors (each found by one more trace).
MAX_REAL_PARTS = 4
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

    def activation_bytes_below(self, threshold: int) -> int:
        """Bytes of the activations held in storages smaller than ``threshold`` bytes."""
        return sum(n for n in self.activation_sizes if n < threshold)

    @property
    def transient_bytes(self) -> int:
        """How far the peak rises above the activations (gradients, recomputation)."""
        return self.peak_bytes - self.activation_bytes


def _leaves(obj: Any) -> List[Any]:
    """The leaves of nested lists, tuples and dicts (an op's arguments or outputs)."""
    if isinstance(obj, (list, tuple)):
        return [leaf for item in obj for leaf in _leaves(item)]
    if isinstance(obj, Mapping):
        return [leaf for item in obj.values() for leaf in _leaves(item)]
    return [obj]


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops create, while they live, by current unit."""

    def __init__(self, limit: Optional[int] = None) -> None:
        super().__init__()
        self.live: Dict[int, Tuple[int, str]] = {}
        self.current = 0
        self.peak = 0
        self.unit_stack: List[str] = ['']
        self.limit = limit  # bytes; beyond them a step on real tensors stops
        self.owner: Optional[_LiveBytes] = None  # the count that adopted these storages

    def _free(self, key: int) -> None:
        nbytes, _ = self.live.pop(key, (0, ''))
        self.current -= nbytes
        if self.owner is not None:
            self.owner._free(key)

    def adopt(self, other: '_LiveBytes', skip: set) -> None:
        """Count ``other``'s live storages (but ``skip``) here too, until they are freed."""
        other.owner = self
        for key, (nbytes, _) in other.live.items():
            if key not in skip:
                self.live[key] = (nbytes, self.unit_stack[-1])
                self.current += nbytes

    def sizes(self) -> Tuple[int, ...]:
        """The size of every live storage, largest first."""
        return tuple(sorted((nbytes for nbytes, _ in self.live.values()), reverse=True))

    def by_unit(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for nbytes, unit in self.live.values():
            out[unit] = out.get(unit, 0) + nbytes
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view, or an in-place op, returns storage it was given: not a new allocation.
        given = {storage_key(t) for t in _leaves((args, kwargs or {}))
                 if isinstance(t, torch.Tensor)}
        for tensor in _leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage_key(tensor)
            if key in given or key in self.live:
                continue
            self.live[key] = (storage.nbytes(), self.unit_stack[-1])
            self.current += storage.nbytes()
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        if self.limit is not None and self.current > self.limit:
            raise MemoryError(f'more than {_size(self.limit)} allocated')
        return out


def _copy_replacing(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are ``make(tensor)``.

    The tensors are never copied themselves: a real model costs no memory, and
    no buffer is deep-copied inside fake mode (a plain buffer cannot be: fake
    tensors have no ``new_empty``). Tied tensors stay one tensor.
    """
    memo: Dict[int, Any] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) not in memo:
            made = make(tensor)
            memo[id(tensor)] = (nn.Parameter(made, tensor.requires_grad)
                                if isinstance(tensor, nn.Parameter) else made)
    return copy.deepcopy(model, memo)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device='meta')


def _fake_copy(shell: nn.Module, compute_dtype: Optional[torch.dtype],
               fp32_modules: Tuple[str, ...] = ()) -> nn.Module:
    """``shell`` (a :func:`_copy_replacing` copy) with fake CPU tensors (call under fake mode).

    Floating-point parameters take ``compute_dtype``, as mixed precision
    gathers them, except those of ``fp32_modules``, which compute in fp32 with
    their inputs cast up and outputs cast back, as the wrappers run them.
    """
    fake = shell
    kept = tuple(fp32_modules)
    made: Dict[int, torch.Tensor] = {}  # by id of the placeholder: tied tensors stay tied

    def empty(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        if dtype is None or not t.is_floating_point():
            dtype = t.dtype
        return torch.empty(t.shape, dtype=dtype, device='cpu')

    for name, module in fake.named_modules():
        in_fp32 = any(name == k or name.startswith(k + '.') for k in kept)
        dtype = None if in_fp32 else compute_dtype
        for pname, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = nn.Parameter(empty(param, dtype), param.requires_grad)
            module.register_parameter(pname, made[id(param)])
        for bname, buffer in list(module.named_buffers(recurse=False)):
            if id(buffer) not in made:
                made[id(buffer)] = empty(buffer, None)
            replace_registered(module, bname, made[id(buffer)])
    if compute_dtype is not None:
        for name in kept:
            compute_in_fp32(fake.get_submodule(name))
    return fake.train()


def _track_units(model: nn.Module, units: Tuple[str, ...], live: _LiveBytes) -> None:
    """Keep ``live.unit_stack`` on the innermost unit whose forward is running."""
    def enter(name: str) -> None:
        live.unit_stack.append(name)

    def leave() -> None:
        live.unit_stack.pop()

    for name in units:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(lambda m, args, name=name: enter(name))
        module.register_forward_hook(lambda m, args, out: leave())


def _loss(output: Any) -> torch.Tensor:
    """The scalar to differentiate: mmengine's ``loss`` entries summed, else every float output."""
    if isinstance(output, Mapping):
        tensors = [v for k, v in output.items() if 'loss' in k]
        output = tensors or list(output.values())
    leaves = [t for t in _leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise ValueError('the traced step produced no differentiable output to call backward on')
    return sum(t.float().sum() if t.dim() else t.float() for t in leaves)


def _preprocessor_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose data preprocessor holds real CPU tensors (the rest: meta).

    The batch is made with real tensors, before fake mode: preprocessing code
    may branch on values (mmengine's ``stack_batch`` on the padding it needs),
    which fake tensors do not have. A meta buffer (a dry run's model) has no
    value either: it becomes ones (floats) or zeros, which keeps the batch's
    shapes and dtypes, all that the trace measures.
    """
    pre = getattr(model, 'data_preprocessor', None)
    own = ({id(t) for t in itertools.chain(pre.parameters(), pre.buffers())}
           if isinstance(pre, nn.Module) else set())

    def make(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in own:
            return _meta(t)
        if not t.is_meta:
            return t.detach().clone()
        fill = torch.ones if t.is_floating_point() else torch.zeros
        return fill(t.shape, dtype=t.dtype, device='cpu')

    return _copy_replacing(model, make)


def _real_batch(model: nn.Module, batch: BatchFn) -> Tuple[tuple, Dict[str, Any], set]:
    """``batch`` run on real tensors, and the storages it allocated (counted in the trace)."""
    made = _LiveBytes()
    with made:
        args, kwargs = batch(_preprocessor_copy(model))
    return args, kwargs, set(made.live)


def _into_trace(value: Any, allocated: set, compute_dtype: Optional[torch.dtype],
                keep: List[torch.Tensor]) -> Any:
    """The batch as the traced step sees it (call under the live-bytes mode).

    What preprocessing allocated is allocated again here, so that it counts
    as it did when the batch was made inside the trace; floating inputs are
    cast to ``compute_dtype``, as mixed precision casts the root's inputs.
    """
    if isinstance(value, (list, tuple)):
        return type(value)(_into_trace(v, allocated, compute_dtype, keep) for v in value)
    if isinstance(value, Mapping):
        return {k: _into_trace(v, allocated, compute_dtype, keep) for k, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    if storage_key(value) in allocated:
        value = value.clone()
        keep.append(value)  # the step holds its preprocessed batch until it ends
    if compute_dtype is not None and value.is_floating_point():
        value = value.to(compute_dtype)
    return value


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any], memo: Optional[dict] = None
                 ) -> Any:
    """``value`` with each tensor ``t`` replaced by ``fn(t)``, copied only where one changed.

    Tensors are found in lists, tuples, dicts and the attributes of plain
    objects (mmengine's data samples, mmdet's boxes).
    """
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        return fn(value)
    if id(value) in memo or isinstance(value, (nn.Module, type, str, bytes)) or callable(value):
        return memo.get(id(value), value)
    memo[id(value)] = value  # cycles end here
    if isinstance(value, (list, tuple)):
        items = [_map_tensors(v, fn, memo) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            memo[id(value)] = (type(value)(*items) if hasattr(value, '_fields')
                               else type(value)(items))
    elif isinstance(value, dict) or hasattr(value, '__dict__'):
        fields = value if isinstance(value, dict) else vars(value)
        items = {k: _map_tensors(v, fn, memo) for k, v in fields.items()}
        if any(items[k] is not v for k, v in fields.items()):
            memo[id(value)] = copy.copy(value)
            (memo[id(value)] if isinstance(value, dict) else vars(memo[id(value)])).update(items)
    return memo[id(value)]


def _real(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor for fake ``t``, of its shape, random values (call outside fake mode)."""
    if not is_fake(t):
        return t
    real = torch.empty(t.shape, dtype=t.dtype)
    real = real.normal_() if real.is_floating_point() else real.zero_()
    return real.requires_grad_(t.requires_grad)


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
            with part.failing_as_itself(), part.real:
                torch.autograd.backward(part.outputs, ones)
            live.peak = max(live.peak, base + part.real.peak)
            part.outputs = []  # the real graph goes; its storages leave ``live`` as they die
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
        self.cause = cause
        self.live, self.limit = live, limit
        self.outputs: List[torch.Tensor] = []

    @contextlib.contextmanager
    def failing_as_itself(self) -> Iterator[None]:
        """An error on real tensors is the model's own (or the limit's): say so, do not retry."""
        try:
            yield
        except RealPartError:
            raise
        except Exception as e:
            hint = (f'; such parts run on this host up to {_size(self.limit)} (a quarter of '
                    "its memory); --input-shape traces the model in mode='tensor' instead"
                    if isinstance(e, MemoryError) else '')
            raise RealPartError(f'{self.name} cannot be traced ({self.cause}) and failed on real '
                                f'CPU tensors too: {_cause(e)}{hint}') from e

    def _input(self, t: torch.Tensor) -> torch.Tensor:
        if is_fake(t) and t.requires_grad:
            self.inputs.append(t)  # its gradient goes back into the trace
        return _real(t)

    def _swap(self, tensors: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """Put ``tensors`` (by id of the ones they replace) in the module; return the old ones."""
        old = {}
        for owner in self.module.modules():
            for name, t in [*owner.named_parameters(recurse=False),
                            *owner.named_buffers(recurse=False)]:
                old[id(tensors[id(t)])] = t
                replace_registered(owner, name, tensors[id(t)])
        return old

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.inputs: List[torch.Tensor] = []
        with dispatch_modes_off(), self.failing_as_itself():
            args, kwargs = _map_tensors((args, kwargs), self._input)
            real = {id(t): (nn.Parameter(_real(t), t.requires_grad) if isinstance(
                t, nn.Parameter) else _real(t)) for t in itertools.chain(
                    self.module.parameters(), self.module.buffers())}
            held = sum(t.nbytes for t in real.values())
            if held > self.limit:
                raise MemoryError(f'its parameters take {_size(held)}')
            for p in real.values():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda p: setattr(p, 'grad', None))
            fakes = self._swap(real)
            self.real = _LiveBytes(self.limit)
            try:
                with self.real:
                    out = self.call(*args, **kwargs)
            finally:
                self._swap(fakes)
            _map_tensors(out, lambda t: self.outputs.append(t) if t.requires_grad else t)
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
    """The fake trace stopped where the model needs tensor values: ``part`` runs on real ones."""

    def __init__(self, part: Tuple[str, str], cause: str) -> None:
        super().__init__(cause)
        self.part, self.cause = part, cause


@contextlib.contextmanager
def _needing_values(model: nn.Module) -> Iterator[None]:
    """Turn an error of the model's code under fake tensors into :class:`_NeedsValues`."""
    try:
        yield
    except RealPartError:
        raise
    except Exception as error:  # where it needs values, and what it was doing there
        raise _NeedsValues(_part_of(error, model), _cause(error)) from error


def _part_of(error: BaseException, model: nn.Module) -> Tuple[str, str]:
    """``(module name, method)`` to run on real tensors after ``error`` in the fake trace.

    The outermost method of a submodule on the failing call stack (a head's
    ``loss``: its result is only summed into the loss), else the model's forward.
    """
    names = {id(m): n for n, m in model.named_modules()}
    found = []
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner, code = frame.f_locals.get('self'), frame.f_code
        method = getattr(type(owner), code.co_name, None) if id(owner) in names else None
        if (callable(method) and getattr(inspect.unwrap(method), '__code__', None) is code
                and not code.co_filename.startswith(TORCH_DIR)):
            found.append((names[id(owner)], code.co_name))
    return next((f for f in found if f[0]), ('', 'forward'))


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
               real_bytes_limit: Optional[int] = None) -> StepTrace:
    """Trace forward + backward of ``model`` (real or on the meta device; left untouched).

    ``units`` are the wrapper's unit names (:attr:`ShardingSpec.units`);
    ``checkpoint_layers`` the classes wrapped in activation checkpointing, in
    the mode of ``checkpointing`` (full when ``None``);
    ``compute_dtype`` the dtype mixed precision computes in, and
    ``fp32_modules`` the modules that compute in fp32 all the same
    (:attr:`ShardingSpec.fp32_units`).

    Where the model needs tensor values, the method of the submodule around it
    runs on real CPU tensors (see :class:`_RealPart`; found by tracing again,
    at most :data:`MAX_REAL_PARTS` times), up to ``real_bytes_limit`` bytes
    (default: a quarter of this host's memory).
    """
    args, kwargs, allocated = _real_batch(model, batch)
    limit = real_bytes_limit or os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 4
    parts: Dict[Tuple[str, str], str] = {}
    while True:
        try:
            return _trace_once(model, args, kwargs, allocated, units, checkpoint_layers,
                               compute_dtype, fp32_modules, checkpointing, parts, limit)
        except _NeedsValues as need:
            if need.part in parts or len(parts) == MAX_REAL_PARTS:
                raise RuntimeError(f'the training step cannot be traced: {need.cause}'
                                   ) from need.__cause__
            parts[need.part] = need.cause


def _trace_once(model: nn.Module, args: tuple, kwargs: Dict[str, Any], allocated: set,
                units: Tuple[str, ...], checkpoint_layers: Tuple[Type[nn.Module], ...],
                compute_dtype: Optional[torch.dtype], fp32_modules: Tuple[str, ...],
                checkpointing: Optional[ActivationCheckpointing],
                parts: Mapping[Tuple[str, str], str], limit: int) -> StepTrace:
    """One trace, ``parts`` (``(module, method)``) on real tensors; raises :class:`_NeedsValues`."""
    shell = _copy_replacing(model, _meta)
    keep: List[torch.Tensor] = []
    with fake_tensor_mode():
        fake = _fake_copy(shell, compute_dtype, fp32_modules)
        live = _LiveBytes()
        _track_units(fake, units, live)
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
        with live:
            args, kwargs = _into_trace((args, kwargs), allocated, compute_dtype, keep)
            with _needing_values(fake):
                output = fake(*args, **kwargs)
            loss = _loss(output)
            del output  # what backward does not need dies here, as in training
            activations, by_unit, sizes = live.current, live.by_unit(), live.sizes()
            with _needing_values(fake):
                loss.backward()
    return StepTrace(activation_bytes=activations, peak_bytes=live.peak, by_unit=by_unit,
                     checkpointed=tuple(c.__name__ for c in checkpoint_layers),
                     compute_dtype=compute_dtype or next(model.parameters()).dtype,
                     activation_sizes=sizes,
                     real_parts=tuple(f'{name or "(root)"}.{method} ({cause})'
                                      for (name, method), cause in parts.items()))
