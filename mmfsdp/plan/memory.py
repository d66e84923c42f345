"""Bytes per rank of a sharding plan: parameters, gradients, optimizer state.

Model-state memory is a function of the unit plan, the dtypes and the world
size, so it can be computed exactly on a model built on the meta device,
without a process group. Frozen parameters (``requires_grad=False``, as
mmdet's ``frozen_stages``) are held and gathered but get no gradient and no
optimizer state, except that FSDP1 keeps a gradient for a whole flat unit
where any of its parameters trains; they are read after ``model.train()``,
which mmengine's loops call before the first step and where models freeze
(mmdet's ResNet ``_freeze_stages``). The estimate of the peak adds the gathered
parameters in flight (the two largest units: the one computing and the one
prefetched); activations depend on the batch and are not included.
"""
import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..wrappers.fsdp import NAME as FSDP1
from .spec import Construction, Padding, ShardingSpec

__all__ = ['Plan', 'Unit', 'make_plan', 'optimizer_states_per_param']

#: Tensors of optimizer state per parameter element, by optimizer type name.
_STATES = {'Adam': 2, 'AdamW': 2, 'Adamax': 2, 'NAdam': 2, 'RAdam': 2, 'Adagrad': 1,
           'RMSprop': 1, 'Adadelta': 2, 'LAMB': 2, 'Lion': 1}


def optimizer_states_per_param(optimizer_cfg: Dict) -> int:
    """State tensors per parameter element of an optimizer config (AdamW: 2)."""
    name = str(optimizer_cfg.get('type', 'AdamW')).split('.')[-1]
    if name == 'SGD':
        return 1 if optimizer_cfg.get('momentum', 0) else 0
    return _STATES.get(name, 2)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit (or the root, named ``''``): a group sharded and gathered together."""

    name: str
    cls: str
    numel: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    #: Bytes of this unit's parameters when gathered for compute.
    gathered_bytes: int
    #: Bytes of this unit's unsharded gradient as the wrapper reduces it: in the
    #: larger of the compute dtype and the mixed-precision ``reduce_dtype`` (FSDP
    #: copies the gradients into a buffer of that dtype for the reduce-scatter);
    #: 0 for a frozen unit.
    reduced_bytes: int = 0
    #: The dtype this unit's gradients are reduced in (reduce-scatter, all-reduce); ``None``
    #: for a frozen unit.
    reduce_dtype: Optional[torch.dtype] = None

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state of this unit on one rank."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class Plan:
    """A sharding plan with its memory per rank; see :func:`make_plan`."""

    spec: ShardingSpec
    world_size: int
    units: Tuple[Unit, ...]
    #: Groups of parameter names that are one tensor (tied weights).
    shared: Tuple[Tuple[str, ...], ...] = field(default=())
    numel: int = 0
    unsharded_bytes: int = 0
    #: Modules whose parameters no unit claims (they stay in the root unit).
    root_modules: Tuple[str, ...] = field(default=())
    #: Bytes of one parameter element (the model's dtype).
    element_bytes: int = 4
    #: Bytes of ``EMAHook``'s averaged parameters on one rank (its own shards), or 0.
    ema_bytes_per_rank: int = 0
    #: Micro-steps per optimizer step (``optim_wrapper.accumulative_counts``).
    accumulative_counts: int = 1

    @property
    def model_state_bytes_per_rank(self) -> int:
        """Parameters + gradients + optimizer state (+ EMA) held by one rank between steps."""
        return sum(u.total_bytes for u in self.units) + self.ema_bytes_per_rank

    @property
    def largest_unit(self) -> Unit:
        """The unit with the largest gathered size (it bounds the all-gather buffer)."""
        return max(self.units, key=lambda u: u.gathered_bytes)

    @property
    def reduced_in_flight_bytes(self) -> int:
        """The largest unsharded gradient being reduced (a reduce-scatter's input)."""
        return max(u.reduced_bytes for u in self.units)

    @property
    def root(self) -> Unit:
        """The root unit: the parameters no other unit claims."""
        return next(u for u in self.units if u.name == '')

    @property
    def construction_bytes_per_rank(self) -> int:
        """Device bytes of parameters while the wrapper builds the model (its peak).

        The full model; or the shards plus 2 x the largest unit (FSDP1 moves a
        unit and flattens it into a copy); or the shards alone (meta init).
        """
        shards = sum(u.param_bytes for u in self.units)
        if self.spec.construction is Construction.SHARDS:
            return shards
        if self.spec.construction is Construction.UNIT_BY_UNIT:
            return shards + 2 * max(u.numel for u in self.units) * self.element_bytes
        return self.numel * self.element_bytes

    @property
    def gathered_in_flight_bytes(self) -> int:
        """Unsharded parameters and gradients alive at once, or 0 when nothing is gathered.

        Parameters: the two largest units (the one computing and the one
        prefetched: two units, so a root larger than every block counts once),
        or every unit when they stay gathered from forward to backward; with
        ``reshard_after_forward=<int>`` the two gathered ones and the others'
        share of a group of that many ranks. Gradients: the largest unit's
        unsharded gradient, which lives in backward until it is
        reduce-scattered, in the reduce dtype.
        """
        kept = self.spec.kept_shard_size
        sizes = sorted((u.gathered_bytes for u in self.units), reverse=True)
        every, pair = sum(sizes), sum(sizes[:2])
        if self.spec.keep_gathered_until_backward and kept > 1:
            params = min(every, pair + -(-(every - pair) // kept))
        elif self.spec.keep_gathered_until_backward:
            params = every
        elif self.spec.shard_size > 1 or self.spec.gathers_unsharded:
            params = pair
        else:
            return 0
        return params + self.reduced_in_flight_bytes

    @property
    def peak_bytes_per_rank_estimate(self) -> int:
        """Model states + gathered parameters in flight; activations not included."""
        return self.model_state_bytes_per_rank + self.gathered_in_flight_bytes


def _shard_numel(params: List[nn.Parameter], spec: ShardingSpec, sharded: bool) -> int:
    """Elements this rank holds of ``params`` (padding included)."""
    numel = sum(p.numel() for p in params)
    if not sharded or spec.shard_size == 1:
        return numel
    if spec.padding is Padding.FLAT:
        return math.ceil(numel / spec.shard_size)
    return sum(math.ceil(p.shape[0] / spec.shard_size) * (p.numel() // max(p.shape[0], 1))
               if p.dim() else p.numel() for p in params)


def _optimizer_numel(params: List[nn.Parameter], spec: ShardingSpec) -> int:
    """Optimizer state elements on the rank holding the most: the trainable part of its shard.

    FSDP1 splits the flat unit evenly, so where frozen and trainable parameters
    share a unit, one rank may hold only trainable ones.
    """
    trainable = [p for p in params if p.requires_grad]
    if spec.padding is not Padding.FLAT or len(trainable) == len(params):
        return _shard_numel(trainable, spec, True)
    chunk = -(-sum(p.numel() for p in params) // spec.shard_size)
    ends = list(itertools.accumulate(p.numel() for p in params))
    spans = [(end - p.numel(), end) for p, end in zip(params, ends) if p.requires_grad]
    return max(sum(max(0, min(end, (r + 1) * chunk) - max(start, r * chunk))
                   for start, end in spans) for r in range(spec.shard_size))


def _unit_params(model: nn.Module, units: Tuple[str, ...]) -> Dict[str, List[nn.Parameter]]:
    """Each unit's parameters, each parameter in the first unit (children first) reaching it."""
    owner: Dict[int, str] = {}
    for name in units:
        for p in model.get_submodule(name).parameters():
            owner.setdefault(id(p), name)
    grouped: Dict[str, List[nn.Parameter]] = {name: [] for name in (*units, '')}
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            grouped[owner.get(id(p), '')].append(p)
    return grouped


@contextlib.contextmanager
def as_trained(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` after ``model.train()``; each module's mode and parameter's flag put back after."""
    modes = [(m, m.training) for m in model.modules()]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.train()
    try:
        yield model
    finally:
        for module, mode in modes:
            module.training = mode
        for param, flag in flags:
            param.requires_grad_(flag)


def make_plan(model: nn.Module, spec: ShardingSpec, world_size: int,
              optimizer_states: int = 2, ema: bool = False,
              accumulative_counts: int = 1,
              reduce_dtype: Optional[torch.dtype] = None) -> Plan:
    """The memory plan of ``model`` (real or on the meta device) under ``spec``.

    With ``ema`` (an ``EMAHook`` is configured), each rank also holds an
    averaged copy of its parameter shards (:mod:`mmfsdp.ema`). With
    ``accumulative_counts > 1`` and ``accumulation='unsharded'``, each rank
    holds full gradients between micro-steps. ``reduce_dtype``: the dtype
    gradients are reduced in under mixed precision (``None``: as computed).
    Trainable parameters are those of ``model.train()`` (:func:`as_trained`).
    """
    with as_trained(model):
        return _make_plan(model, spec, world_size, optimizer_states, ema, accumulative_counts,
                          reduce_dtype)


def _make_plan(model: nn.Module, spec: ShardingSpec, world_size: int, optimizer_states: int,
               ema: bool, accumulative_counts: int, reduce_dtype: Optional[torch.dtype]) -> Plan:
    grads_sharded = not (accumulative_counts > 1 and spec.unsharded_accumulation)
    grouped = _unit_params(model, spec.units)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    units, trained = [], 0
    for name, params in sorted(grouped.items(), key=lambda item: order[item[0]]):
        if not params and name:
            continue
        dtype_bytes = params[0].element_size() if params else 4
        # Modules kept in fp32 are gathered in their parameters' dtype (fp32), not compute_dtype.
        compute_bytes = (torch.empty((), dtype=spec.compute_dtype).element_size()
                         if spec.compute_dtype and name not in spec.fp32_units else dtype_bytes)
        numel = sum(p.numel() for p in params)
        # FSDP1 keeps one gradient for its flat unit, none where no parameter trains
        trainable = [p for p in params if p.requires_grad]
        with_grads = params if spec.wrapper == FSDP1 and trainable else trainable
        param_numel = _shard_numel(params, spec, True)
        grad_numel = _shard_numel(with_grads, spec, grads_sharded)
        module = model.get_submodule(name) if name else model
        # Modules kept in fp32 reduce in fp32 too; the others in reduce_dtype when one is set.
        compute = (spec.compute_dtype if spec.compute_dtype and name not in spec.fp32_units
                   else params[0].dtype if params else torch.float32)
        reduced_in = (reduce_dtype if reduce_dtype is not None and name not in spec.fp32_units
                      else compute)
        reduce_bytes = reduced_in.itemsize
        trained += sum(p.numel() for p in trainable)
        units.append(Unit(name=name, cls=type(module).__name__, numel=numel,
                          param_bytes=param_numel * dtype_bytes,
                          grad_bytes=grad_numel * dtype_bytes,
                          optimizer_bytes=(_optimizer_numel(params, spec) * dtype_bytes
                                           * optimizer_states),
                          gathered_bytes=numel * compute_bytes,
                          reduced_bytes=(sum(p.numel() for p in with_grads)
                                         * max(reduce_bytes, compute_bytes)),
                          reduce_dtype=reduced_in if with_grads else None))
    names: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    shared = tuple(tuple(ns) for ns in names.values() if len(ns) > 1)
    root_ids = {id(p) for p in grouped['']}
    root_modules = tuple(dict.fromkeys(
        n.rsplit('.', 1)[0] if '.' in n else '(root)'
        for n, p in model.named_parameters() if id(p) in root_ids))
    total = sum(u.numel for u in units)
    elem = next(model.parameters()).element_size() if total else 4
    return Plan(spec=spec, world_size=world_size, units=tuple(units), shared=shared, numel=total,
                unsharded_bytes=elem * (total * (1 + int(ema)) + trained * (1 + optimizer_states)),
                root_modules=root_modules, element_bytes=elem,
                ema_bytes_per_rank=sum(u.param_bytes for u in units) if ema else 0,
                accumulative_counts=accumulative_counts)
