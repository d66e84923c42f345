"""``MMFullyShard``: torch's FSDP2 (``fully_shard``) for mmengine models, and its config."""
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..compat import checkpoint_inner
from ..dist import current_device, local_world_size, teardown_at_exit
from ..layers import ActivationCheckpointing, RegionalCompile, prepare_layers
from ..meta_init import check_meta_model, materialize
from ..optim import clip_grads_by_global_norm
from ..options import (
    FP32_MODULES_DEFAULT,
    NODE,
    Accumulation,
    Fp32Modules,
    MeshSpec,
    check_fp32_modules,
    move_fp32_modules,
    reject_fsdp1_options,
    resolve_accumulation,
    resolve_flag,
    resolve_init_device,
    resolve_mesh,
    resolve_mp_policy,
    resolve_offload_policy,
    resolve_reshard_after_forward,
    translate_sharding_strategy,
)
from ..policies import PolicyConfig, merge_units_sharing_parameters
from ..registry import MODEL_WRAPPERS
from ..together import UsageProbe, check_same_parameters_used
from .base import (
    AccumulationNoSync,
    Construction,
    DataParallelSteps,
    Layout,
    ModelHolder,
    Padding,
    ParallelWrapper,
    ShardingSpec,
    WrapperConfig,
    fp32_module_names,
    reject_stock_runner,
    resolved,
    units_children_first,
    within,
)

__all__ = ['FullyShardConfig', 'MMFullyShard', 'shard_model']

NAME = 'mmfsdp.MMFullyShard'


@dataclass(frozen=True)
class FullyShardConfig(WrapperConfig):
    """The configuration of :class:`MMFullyShard`, resolved.

    An FSDP1 ``sharding_strategy`` is translated into ``reshard_after_forward``
    (and, for the hybrid strategies, the mesh).
    """

    #: Which submodules get their own ``fully_shard`` (same policies as FSDP1).
    auto_wrap_policy: PolicyConfig = None
    #: Free the gathered parameters after forward (True, ZeRO-3), keep them
    #: until backward (False, ZeRO-2), or keep them gathered within groups of
    #: this many ranks (int).
    reshard_after_forward: Union[bool, int] = True
    #: ``replicate x shard`` ranks; ``replicate > 1`` is hybrid sharding.
    mesh: MeshSpec = field(default_factory=MeshSpec)
    #: Compute / reduce / output dtypes.
    mixed_precision: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    #: Keep sharded parameters, gradients and optimizer state on the CPU.
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    #: ``dict(layer_cls=[...], mode=...)``: layers whose activations are
    #: recomputed in backward (:mod:`mmfsdp.layers`).
    activation_checkpointing: Optional[ActivationCheckpointing] = None
    #: ``dict(layer_cls=[...], **torch.compile options)``: layers compiled one by one.
    regional_compile: Optional[RegionalCompile] = None
    #: ``'meta'``: build on the meta device, shard, then materialise each shard.
    init_device: Optional[str] = None
    #: Reduce a zero gradient for every parameter that got none in this rank's
    #: backward (ranks that use different parameters: a head used on some ranks
    #: only, MoE experts). Without it the first training forward checks that
    #: the ranks used the same parameters (a hang in backward otherwise).
    find_unused_parameters: bool = False
    #: ``'sharded'`` reduce-scatters every micro-step, ``'unsharded'`` keeps full
    #: local gradients (and, with ``reshard_after_forward=False``, the gathered
    #: parameters) until the last (see :mod:`mmfsdp.options`).
    accumulation: Accumulation = Accumulation.SHARDED
    #: ``mixed_precision.fp32_modules``: module classes (or their names) that
    #: compute in fp32 under a lower ``param_dtype``, each its own group.
    fp32_modules: Fp32Modules = FP32_MODULES_DEFAULT

    NAME: ClassVar[str] = NAME
    RESOLVERS: ClassVar[Mapping[str, Any]] = dict(
        reshard_after_forward=resolve_reshard_after_forward,
        mesh=resolve_mesh,
        mixed_precision=resolve_mp_policy,
        offload=resolve_offload_policy,
        init_device=resolve_init_device,
        find_unused_parameters=lambda v: resolve_flag(
            v, key='model_wrapper_cfg.find_unused_parameters'),
        accumulation=resolve_accumulation,
        fp32_modules=check_fp32_modules,
    )
    TRANSLATED: ClassVar[Tuple[str, ...]] = ('sharding_strategy', )

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> 'FullyShardConfig':
        """Resolve a ``model_wrapper_cfg``; FSDP1-only options are refused with their FSDP2 form."""
        reject_fsdp1_options(cfg)
        return super().from_dict(cfg)

    @classmethod
    def _translate(cls, cfg: Dict[str, Any]) -> Dict[str, Any]:
        if cfg.get('sharding_strategy') is not None:
            cfg.update(_from_sharding_strategy(cfg))
        cfg.pop('sharding_strategy', None)
        return move_fp32_modules(cfg)

    def _merge(self, module: nn.Module, units: Tuple[str, ...]) -> Tuple[str, ...]:
        """FSDP2 allows one group per parameter: units sharing one are merged."""
        return tuple(merge_units_sharing_parameters(module, units)[0])

    def _fp32_modules(self, module: nn.Module) -> Tuple[str, ...]:
        return fp32_module_names(module, self.fp32_modules, self.mixed_precision.param_dtype)

    def layout(self, module: nn.Module) -> Layout:
        """The base layout, refused where torch 2.13's FSDP2 would fail at the first forward."""
        layout = super().layout(module)
        check_groups(module, layout)
        return layout

    def _check_own_steps(self, module: nn.Module) -> None:
        """``'unsharded'`` / ``'hybrid'`` act at the wrapper's forward, which such a model skips."""
        if self.accumulation is not Accumulation.SHARDED:
            raise ValueError(
                f'model_wrapper_cfg.accumulation={self.accumulation.value!r}: '
                f'{type(module).__name__} runs its own train_step, which calls its children '
                f"directly, past {NAME}'s forward where no_sync takes effect; use "
                "accumulation='sharded' (the same numbers) or "
                "type='mmfsdp.MMFullyShardedDataParallel'")

    @property
    def offloads_to_cpu(self) -> bool:
        """``offload=dict(cpu_offload=True)``."""
        return isinstance(self.offload, CPUOffloadPolicy)

    def check_device(self, device: torch.device) -> None:
        """Pinned memory needs an accelerator."""
        if (isinstance(self.offload, CPUOffloadPolicy) and self.offload.pin_memory
                and device.type == 'cpu'):
            raise ValueError('model_wrapper_cfg.offload.pin_memory: pinned memory needs an '
                             'accelerator and this process trains on the CPU; set '
                             'pin_memory=False, or leave offload out (the parameters are on '
                             'the CPU already)')

    def sharding_spec(self, layout: Layout, world_size: int) -> ShardingSpec:
        """``shard='node'`` means ``LOCAL_WORLD_SIZE`` ranks (the whole world when unset)."""
        local = local_world_size() or world_size
        replicate, shard = self.mesh.sizes(world_size, min(local, world_size)
                                           if self.mesh.shard == NODE else None)
        reshard = self.reshard_after_forward
        return ShardingSpec(
            wrapper=NAME, strategy=f'reshard_after_forward={reshard}',
            shard_size=shard, replicate_size=replicate,
            units=units_children_first(layout.units, layout.fp32_modules),
            fp32_units=layout.fp32_modules,
            padding=Padding.DIM0 if shard > 1 else Padding.NONE,
            shard_params=shard > 1, shard_grads=shard > 1, shard_optimizer=shard > 1,
            keep_gathered_until_backward=shard > 1 and reshard is not True,
            kept_shard_size=reshard if type(reshard) is int else 1,
            compute_dtype=self.mixed_precision.param_dtype,
            construction=Construction.SHARDS if self.init_device == 'meta' else Construction.FULL,
            gathers_unsharded=True, grads_freed_between_steps=True,
            checkpoint_layers=layout.checkpoint_layers,
            unsharded_accumulation=self.accumulation is Accumulation.UNSHARDED)


def _groups(module: nn.Module, layout: Layout) -> List[str]:
    """The modules ``fully_shard`` is applied to, children first (the roots last)."""
    kept = [name for name in layout.fp32_modules
            if any(True for _ in module.get_submodule(name).parameters())]
    roots = list(layout.roots) if layout.roots is not None else ['']
    inner = [name for name in units_children_first(layout.units, tuple(kept)) if name not in roots]
    return inner + roots


def check_groups(module: nn.Module, layout: Layout) -> None:
    """Refuse a layout whose FSDP2 groups torch 2.13 would reject at the first forward.

    Every parameter belongs to the innermost group enclosing where it is first
    registered. Raises ``ValueError`` naming the modules when a group's
    trainable parameters have different dtypes (FSDP2 asserts one dtype per
    group: pytorch #156784), or when a module kept in fp32 shares a parameter
    with a module outside it (FSDP2 gives a parameter to one group only).
    """
    groups = _groups(module, layout)
    by_group: Dict[str, Dict[torch.dtype, List[str]]] = {}
    for name, param in module.named_parameters():
        owner = next((g for g in groups if within(name.rpartition('.')[0], g)), None)
        if owner is not None and param.requires_grad:
            by_group.setdefault(owner, {}).setdefault(param.dtype, []).append(name)
    for group, dtypes in by_group.items():
        if len(dtypes) > 1:
            listed = '; '.join(f'{str(d).replace("torch.", "")}: {names}'
                               for d, names in dtypes.items())
            raise ValueError(
                f'{NAME}: the FSDP2 group {group or type(module).__name__ + " (root)"!r} would '
                f'hold trainable parameters of different dtypes ({listed}); torch '
                f'{torch.__version__} requires one dtype per group (pytorch #156784). Give the '
                'parameters one dtype (mixed precision is model_wrapper_cfg.mixed_precision), '
                'make the differing modules units of their own (auto_wrap_policy), or list '
                'their class in mixed_precision.fp32_modules')
    kept = set(layout.fp32_modules)
    if not kept:
        return
    names: Dict[int, List[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for shared in (ns for ns in names.values() if len(ns) > 1):
        owners = {next((k for k in kept if within(n.rpartition('.')[0], k)), None)
                  for n in shared}
        if len(owners) > 1:
            raise ValueError(
                f'{NAME}: parameter {" = ".join(shared)} is shared by a module kept in fp32 '
                f'({", ".join(sorted(o for o in owners if o is not None))}) and a module '
                'outside it; FSDP2 gives a parameter to one group, so it cannot compute in '
                'fp32 in one and in low precision in the other. Remove its class from '
                'model_wrapper_cfg.mixed_precision.fp32_modules, or stop sharing the parameter')


def _from_sharding_strategy(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """``reshard_after_forward`` (and the hybrid mesh) an FSDP1 strategy name stands for."""
    if 'reshard_after_forward' in cfg:
        raise TypeError('model_wrapper_cfg: give reshard_after_forward or sharding_strategy '
                        '(translated to it), not both')
    reshard, hybrid = translate_sharding_strategy(cfg['sharding_strategy'])
    out: Dict[str, Any] = dict(reshard_after_forward=reshard)
    if hybrid:
        mesh = resolve_mesh(cfg.get('mesh'))
        if 'mesh' not in cfg:
            mesh = MeshSpec(replicate=-1, shard='node')  # FSDP1's layout: shard within a node
        elif mesh.replicate == 1:
            raise ValueError('model_wrapper_cfg.sharding_strategy: '
                             f'{cfg["sharding_strategy"]!r} replicates '
                             'across groups, but mesh has replicate=1; set mesh=dict('
                             'replicate=R, shard=S) with R > 1, or leave mesh out to shard '
                             'within each node')
        out['mesh'] = mesh
    return out


def _build_mesh(spec: MeshSpec, device: torch.device) -> DeviceMesh:
    """A 1-D ``('shard',)`` mesh, or 2-D ``('replicate', 'shard')`` for hybrid sharding."""
    replicate, shard = spec.sizes(dist.get_world_size(), local_world_size())
    if replicate == 1:
        return init_device_mesh(device.type, (shard, ), mesh_dim_names=('shard', ))
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=('replicate', 'shard'))


def _check_reshard_after_forward(value: Union[bool, int], mesh: DeviceMesh) -> None:
    """An int ``reshard_after_forward`` must divide the shard group size (1 and itself excluded)."""
    if isinstance(value, bool):
        return
    size = mesh.size(mesh.ndim - 1)
    if value >= size or size % value:
        divisors = [d for d in range(2, size) if size % d == 0]
        raise ValueError('model_wrapper_cfg.reshard_after_forward: '
                         f'{value} is not a divisor of the shard group '
                         f'size {size} other than 1 and {size}; valid ints here are {divisors} '
                         '(or use True / False)')


#: The groups of modules kept in fp32: gathered, computed and reduced in fp32. The
#: inputs and outputs are cast by :func:`compute_in_fp32`, not by FSDP2, so that the
#: output gets back the dtype the input came in (FSDP1's behaviour).
FP32_POLICY = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                   cast_forward_inputs=False)


def shard_model(module: nn.Module, mesh: DeviceMesh, layout: Layout, *,
                reshard_after_forward: Union[bool, int], mp_policy: MixedPrecisionPolicy,
                offload_policy: OffloadPolicy) -> List[nn.Module]:
    """Apply ``fully_shard`` to the layout's units (children first), then to the root(s).

    The modules kept in fp32 (``layout.fp32_modules``) with parameters are
    groups of their own under :data:`FP32_POLICY`, as is any unit inside one.
    The layers are checkpointed and compiled first (:func:`prepare_layers`),
    so a unit that is a checkpointed layer is sharded as its checkpoint
    wrapper. Returns the roots.
    """
    roots = list(layout.roots) if layout.roots is not None else ['']
    targets = {name: module.get_submodule(name) for name in _groups(module, layout)}
    kept = [module.get_submodule(name) for name in layout.fp32_modules]
    prepare_layers(module, layout)
    outer = {id(checkpoint_inner(m)): m for m in module.modules()
             if checkpoint_inner(m) is not None}
    shard = functools.partial(fully_shard, mesh=mesh, offload_policy=offload_policy)
    for name, target in targets.items():
        in_fp32 = any(within(name, kept) for kept in layout.fp32_modules)
        # The root's parameters are needed first in backward: like torch's default,
        # keep them gathered after forward unless asked for ZeRO-2/groups explicitly.
        reshard = (None if name in roots and reshard_after_forward is True
                   else reshard_after_forward)
        shard(outer.get(id(target), target), reshard_after_forward=reshard,
              mp_policy=FP32_POLICY if in_fp32 else mp_policy)
    for target in kept:
        compute_in_fp32(target)
    return [outer.get(id(targets[name]), targets[name]) for name in roots]


def compute_in_fp32(module: nn.Module) -> None:
    """Run ``module`` in fp32: floating inputs cast up, floating outputs cast back.

    The outputs take the dtype of the first floating-point input (the dtype the
    surrounding mixed precision computes in), as FSDP1 does for the modules of
    ``MixedPrecision._module_classes_to_ignore``. The hooks are appended, so
    they run after FSDP2's own (its gather before, its reshard after).
    """
    came_in: List[Optional[torch.dtype]] = []  # a stack: a recomputation may nest a call

    def cast_up(_: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        came_in.append(_first_float_dtype((args, kwargs)))
        return _cast_floats((args, kwargs), torch.float32)

    def cast_back(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        dtype = came_in.pop()
        return output if dtype in (None, torch.float32) else _cast_floats(output, dtype)

    module.register_forward_pre_hook(cast_up, with_kwargs=True)
    module.register_forward_hook(cast_back, with_kwargs=True)


def _first_float_dtype(value: Any) -> Optional[torch.dtype]:
    """The dtype of the first floating-point tensor in nested tuples / lists / dicts."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else (
        value if isinstance(value, (list, tuple)) else ())
    return next((d for d in map(_first_float_dtype, items) if d is not None), None)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in nested tuples / lists / dicts cast."""
    cast: Callable[[Any], Any] = functools.partial(_cast_floats, dtype=dtype)
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)((k, cast(v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, '_fields'):  # a namedtuple
        return type(value)(*map(cast, value))
    if isinstance(value, (list, tuple)):
        return type(value)(map(cast, value))
    return value


@MODEL_WRAPPERS.register_module()
class MMFullyShard(DataParallelSteps, AccumulationNoSync, ModelHolder, ParallelWrapper):
    """Fully sharded data parallel with torch's ``fully_shard`` (FSDP2).

    The model is sharded in place (DTensor parameters, one ``fully_shard`` group
    per unit of the wrap policy, plus the root) and held as ``self.module``;
    names and state dicts are the unwrapped model's, so full checkpoints move
    freely between this wrapper, FSDP1, DDP and one process. A model with its
    own steps gets one root per child with parameters. The keyword arguments
    are the fields of :class:`FullyShardConfig`.

    Config::

        runner_type = 'mmfsdp.FSDPRunner'
        model_wrapper_cfg = dict(
            type='mmfsdp.MMFullyShard',
            auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
            reshard_after_forward=True,            # bool | int
            mesh=dict(replicate=1, shard=-1),      # replicate > 1: hybrid sharding
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32',
                                 fp32_modules=['_BatchNorm']),  # the default; [] off
            offload=dict(cpu_offload=False),
            activation_checkpointing=dict(layer_cls=['TransformerBlock']),
            init_device=None,                      # 'meta': never hold the full model
            find_unused_parameters=False,          # True: ranks may use different params
            accumulation='sharded')                # 'unsharded': no_sync, full gradients
    """

    supports_meta_init = True
    CONFIG = FullyShardConfig

    def __init__(self, module: nn.Module, *, config: Optional[FullyShardConfig] = None,
                 layout: Optional[Layout] = None, **options: Any) -> None:
        reject_stock_runner(type(self).__name__)
        super().__init__()
        cfg = resolved(FullyShardConfig, config, options)
        device = current_device()
        cfg.check_device(device)
        layout = layout or cfg.layout(module)
        self.mesh = _build_mesh(cfg.mesh, device)
        _check_reshard_after_forward(cfg.reshard_after_forward, self.mesh)
        on_meta = check_meta_model(module, cfg.init_device, 'after sharding')
        self.units = list(u for u in layout.units if u not in (layout.roots or ()))
        self._roots = shard_model(module, self.mesh, layout,
                                  reshard_after_forward=cfg.reshard_after_forward,
                                  mp_policy=cfg.mixed_precision, offload_policy=cfg.offload)
        if cfg.find_unused_parameters:
            for root in self._roots:
                root.set_reduce_scatter_unused_params(True)
        # The first training forward checks that no rank left a parameter unused that
        # another used. A model with its own steps never runs that forward: no probe.
        self._usage_probe = (UsageProbe(module) if not cfg.find_unused_parameters
                             and layout.roots is None else None)
        if on_meta:
            materialize(module, device, self.mesh)
        self.module = module
        self._accumulation = cfg.accumulation
        teardown_at_exit()
        # ZeRO-2 keeps parameters gathered to backward; 'unsharded' then keeps them
        # across micro-steps too.
        self._keep_gathered = (cfg.accumulation is Accumulation.UNSHARDED
                               and cfg.reshard_after_forward is False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The sharded model's forward; the coming backward reduces unless inside no_sync."""
        for root in self._roots:
            root.set_requires_gradient_sync(self._sync_next_backward)
            root.set_requires_all_reduce(self._all_reduce_next_backward)
            if self._keep_gathered:  # the last micro-step reshards after its backward again
                root.set_reshard_after_backward(self._sync_next_backward)
        output = self.module(*args, **kwargs)
        if self._usage_probe is not None and self.training and torch.is_grad_enabled():
            probe, self._usage_probe = self._usage_probe, None
            check_same_parameters_used(probe.remove())
        return output

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their global norm; return that norm as a plain tensor."""
        return clip_grads_by_global_norm(self, self.parameters(), max_norm, norm_type)
