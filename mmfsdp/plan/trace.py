"""Activation memory of one training step, traced with fake tensors (no memory, any device).

The model's forward and backward run under ``FakeTensorMode`` while a dispatch
mode follows every storage: the activations alive when forward ends (per unit)
and the peak of forward + backward. What the wrapper does with parameters and
gradients is added by :mod:`.step` from the plan (``docs/plan.md``).
"""
import copy
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

import torch
from torch import nn

from ..checkpointing import ActivationCheckpointing, apply_activation_checkpointing_to
from ..compat import TorchDispatchMode, fake_tensor_mode, replace_registered, storage_key
from ..wrappers.fsdp2 import compute_in_fp32

__all__ = ['StepTrace', 'trace_step']

#: Makes the training batch inside the trace: ``(model) -> (args, kwargs)`` of a
#: call whose result holds the loss (see :mod:`.batch`).
BatchFn = Callable[[nn.Module], Tuple[tuple, Dict[str, Any]]]


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

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, Tuple[int, str]] = {}
        self.current = 0
        self.peak = 0
        self.unit_stack: List[str] = ['']

    def _free(self, key: int) -> None:
        nbytes, _ = self.live.pop(key, (0, ''))
        self.current -= nbytes

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


def trace_step(model: nn.Module, batch: BatchFn, units: Tuple[str, ...] = (),
               checkpoint_layers: Tuple[Type[nn.Module], ...] = (),
               compute_dtype: Optional[torch.dtype] = None,
               fp32_modules: Tuple[str, ...] = (),
               checkpointing: Optional[ActivationCheckpointing] = None) -> StepTrace:
    """Trace forward + backward of ``model`` (real or on the meta device; left untouched).

    ``units`` are the wrapper's unit names (:attr:`ShardingSpec.units`);
    ``checkpoint_layers`` the classes wrapped in activation checkpointing, in
    the mode of ``checkpointing`` (full when ``None``);
    ``compute_dtype`` the dtype mixed precision computes in, and
    ``fp32_modules`` the modules that compute in fp32 all the same
    (:attr:`ShardingSpec.fp32_units`).
    """
    args, kwargs, allocated = _real_batch(model, batch)
    shell = _copy_replacing(model, _meta)
    keep: List[torch.Tensor] = []
    with fake_tensor_mode():
        fake = _fake_copy(shell, compute_dtype, fp32_modules)
        live = _LiveBytes()
        _track_units(fake, units, live)
        apply_activation_checkpointing_to(fake, tuple(checkpoint_layers), checkpointing)
        for param in fake.parameters():
            # The wrapper takes each gradient as it is accumulated (reduces it into
            # its own buffers, counted by the plan): keep none here.
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, 'grad', None))
        with live:
            args, kwargs = _into_trace((args, kwargs), allocated, compute_dtype, keep)
            loss = _loss(fake(*args, **kwargs))
            activations, by_unit, sizes = live.current, live.by_unit(), live.sizes()
            loss.backward()
    return StepTrace(activation_bytes=activations, peak_bytes=live.peak, by_unit=by_unit,
                     checkpointed=tuple(c.__name__ for c in checkpoint_layers),
                     compute_dtype=compute_dtype or next(model.parameters()).dtype,
                     activation_sizes=sizes)
