"""``MMFullyShard``: torch's FSDP2 (``fully_shard``) for mmengine models."""
import contextlib
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from ..activation_checkpointing import (
    apply_activation_checkpointing_to,
    resolve_activation_checkpointing,
)
from ..clip import clip_grads_by_global_norm
from ..dist import current_device, local_world_size
from ..meta_init import check_init_cfgs, materialize
from ..options import (
    NODE,
    MeshSpec,
    check_keys,
    reject_fsdp1_options,
    resolve_flag,
    resolve_init_device,
    resolve_mesh,
    resolve_mp_policy,
    resolve_offload_policy,
    resolve_reshard_after_forward,
    translate_sharding_strategy,
)
from ..plan.spec import Construction, Padding, ShardingSpec
from ..policies import PolicyConfig, WrapPolicy, build_wrap_policy, plan_units
from ..registry import MODEL_WRAPPERS
from ..tied import merge_units_sharing_parameters
from ..unused_params import UsageProbe, check_same_parameters_used
from .guard import reject_stock_runner
from .holder import ModelHolder
from .mesh import build_mesh, check_reshard_after_forward
from .separate import separate_roots
from .steps import DataParallelSteps, own_steps

__all__ = ['FullyShardConfig', 'MMFullyShard', 'shard_model', 'unit_plan']


@dataclass(frozen=True)
class FullyShardConfig:
    """The configuration of :class:`MMFullyShard`, resolved.

    :meth:`from_dict` turns the user's strings into torch values and
    translates an FSDP1 ``sharding_strategy``; the model-dependent options stay
    as written until :meth:`for_model` checks them against the model.
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
    #: ``dict(layer_cls=[...])``: layers whose activations are recomputed in backward.
    activation_checkpointing: Optional[Mapping[str, Any]] = None
    #: ``'meta'``: build on the meta device, shard, then materialise each shard.
    init_device: Optional[str] = None
    #: Reduce a zero gradient for every parameter that got none in this rank's
    #: backward (as DDP's option of this name, and FSDP1 always): needed when
    #: ranks use different parameters (a head used on some ranks only, MoE
    #: experts); without it their reduce-scatters do not match, which the first
    #: training forward detects (an error naming the parameters). Costs the
    #: zeros' communication. Every sharded unit must still run its forward on
    #: every rank.
    find_unused_parameters: bool = False

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> 'FullyShardConfig':
        """Resolve a ``model_wrapper_cfg`` (without ``type``), raising on bad input."""
        reject_fsdp1_options(cfg)
        names = [f.name for f in fields(cls)]
        check_keys(cfg, names + ['sharding_strategy'], 'model_wrapper_cfg')
        cfg = dict(cfg)
        if cfg.get('sharding_strategy') is not None:
            cfg.update(_from_sharding_strategy(cfg))
        cfg.pop('sharding_strategy', None)
        return cls(**{name: _RESOLVERS.get(name, _as_is)(value) for name, value in cfg.items()})

    def for_model(self, module: nn.Module) -> Tuple[Optional[WrapPolicy], Tuple[Type[nn.Module],
                                                                                ...]]:
        """The wrap policy and the checkpointed layer classes, checked against ``module``."""
        return (build_wrap_policy(self.auto_wrap_policy, module),
                resolve_activation_checkpointing(self.activation_checkpointing, module))

    def check_device(self, device: torch.device) -> None:
        """Raise on options the training device cannot honour."""
        if (isinstance(self.offload, CPUOffloadPolicy) and self.offload.pin_memory
                and device.type == 'cpu'):
            raise ValueError('model_wrapper_cfg.offload.pin_memory: '
                             'pinned memory needs an accelerator and this '
                             'process trains on the CPU; set pin_memory=False, or leave offload '
                             'out (the parameters are on the CPU already)')


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


def _as_is(value: Any) -> Any:
    return value


_RESOLVERS: Dict[str, Callable[[Any], Any]] = dict(
    reshard_after_forward=resolve_reshard_after_forward,
    mesh=resolve_mesh,
    mixed_precision=resolve_mp_policy,
    offload=resolve_offload_policy,
    init_device=resolve_init_device,
    find_unused_parameters=lambda v: resolve_flag(v, 'model_wrapper_cfg.find_unused_parameters'),
)


def unit_plan(module: nn.Module, policy: Optional[WrapPolicy]) -> List[str]:
    """The units ``fully_shard`` is applied to, children first: the policy's, merged for ties."""
    units = plan_units(module, policy) if policy is not None else []
    return merge_units_sharing_parameters(module, units)[0]


def shard_model(module: nn.Module, mesh: DeviceMesh, policy: Optional[WrapPolicy],
                checkpoint_layers: Tuple[Type[nn.Module], ...], *,
                reshard_after_forward: Union[bool, int],
                mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy,
                roots: Optional[List[str]] = None) -> List[str]:
    """Apply ``fully_shard`` to the policy's units (children first), then to ``module``.

    With ``roots`` (children of ``module``), those are sharded as separate
    roots instead of ``module`` (:mod:`mmfsdp.wrappers.separate`). Units
    sharing a parameter are merged first (:mod:`mmfsdp.tied`); the
    checkpointed layers are wrapped before sharding, so a unit that is such a
    layer is sharded as its checkpoint wrapper. Returns the sharded unit names.
    """
    units = [name for name in unit_plan(module, policy) if name not in (roots or ())]
    targets = [module.get_submodule(name) for name in units]
    root_modules = [module.get_submodule(name) for name in roots or ()]
    apply_activation_checkpointing_to(module, checkpoint_layers)
    outer = {id(m._checkpoint_wrapped_module): m for m in module.modules()
             if hasattr(m, '_checkpoint_wrapped_module')}
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy,
                              offload_policy=offload_policy)
    for target in targets:
        shard(outer.get(id(target), target), reshard_after_forward=reshard_after_forward)
    # The root's parameters are needed first in backward: like torch's default,
    # keep them gathered after forward unless asked for ZeRO-2/groups explicitly.
    for root in root_modules or [module]:
        shard(outer.get(id(root), root), reshard_after_forward=None
              if reshard_after_forward is True else reshard_after_forward)
    return units


@MODEL_WRAPPERS.register_module()
class MMFullyShard(DataParallelSteps, ModelHolder):
    """Fully sharded data parallel with torch's ``fully_shard`` (FSDP2).

    The model is sharded in place: parameters become DTensors sharded over the
    mesh's ``shard`` dimension, one ``fully_shard`` group per unit that the
    wrap policy picks (bottom-up), plus the root. The wrapper is a thin module
    holding it as ``self.module`` (mmengine's wrapper contract); state dicts,
    including ``torch.distributed.checkpoint.state_dict``'s, use the
    unwrapped model's keys, so full checkpoints move freely between this wrapper,
    FSDP1, DDP and one process.

    The keyword arguments are the fields of :class:`FullyShardConfig`; FSDP1's
    ``sharding_strategy`` is accepted and translated. Build it through
    :class:`mmfsdp.FSDPRunner`; mmengine's stock Runner is refused.

    Config::

        runner_type = 'mmfsdp.FSDPRunner'
        model_wrapper_cfg = dict(
            type='mmfsdp.MMFullyShard',
            auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
            reshard_after_forward=True,            # bool | int
            mesh=dict(replicate=1, shard=-1),      # replicate > 1: hybrid sharding
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32'),
            offload=dict(cpu_offload=False),
            activation_checkpointing=dict(layer_cls=['TransformerBlock']),
            init_device=None,                      # 'meta': never hold the full model
            find_unused_parameters=False)          # True: ranks may use different params
    """

    #: :class:`mmfsdp.FSDPRunner` may build the model on the meta device for it.
    supports_meta_init = True

    def __init__(self, module: nn.Module, **config: Any) -> None:
        reject_stock_runner(type(self).__name__)
        super().__init__()
        cfg = FullyShardConfig.from_dict(config)
        policy, checkpoint_layers = cfg.for_model(module)
        device = current_device()
        cfg.check_device(device)
        self.mesh = build_mesh(cfg.mesh, device)
        check_reshard_after_forward(cfg.reshard_after_forward, self.mesh)
        on_meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
        if on_meta and cfg.init_device != 'meta':
            raise ValueError('model_wrapper_cfg.init_device: the model is on the meta device; '
                             "set init_device='meta' to materialise it after sharding")
        if on_meta:
            check_init_cfgs(module)
        # A model with its own steps calls its children directly: each is its own root.
        roots = separate_roots(module, 'mmfsdp.MMFullyShard') if own_steps(module) else None
        self.units = shard_model(module, self.mesh, policy, checkpoint_layers,
                                 reshard_after_forward=cfg.reshard_after_forward,
                                 mp_policy=cfg.mixed_precision, offload_policy=cfg.offload,
                                 roots=roots)
        self._roots = [module.get_submodule(n) for n in roots] if roots else [module]
        if cfg.find_unused_parameters:
            for root in self._roots:
                root.set_reduce_scatter_unused_params(True)
        # Without the option, the first training forward checks that no rank left
        # a parameter unused that another used (a hang in backward otherwise).
        self._usage_probe = None if cfg.find_unused_parameters else UsageProbe(module)
        if on_meta:
            materialize(module, device, self.mesh)
        self.module = module
        self._sync_gradients = True

    @classmethod
    def check_config(cls, config: Mapping[str, Any], module: Optional[nn.Module] = None) -> None:
        """Raise on a bad config; with ``module``, check the model-dependent options too.

        Lets a runner reject a config on every rank before any collective.
        """
        cfg = FullyShardConfig.from_dict(config)
        cfg.check_device(current_device())
        if module is not None:
            cfg.for_model(module)
            if own_steps(module):
                separate_roots(module, 'mmfsdp.MMFullyShard')

    @classmethod
    def offloads_to_cpu(cls, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` keeps the parameters on the CPU (``offload``)."""
        return isinstance(FullyShardConfig.from_dict(config).offload, CPUOffloadPolicy)

    @classmethod
    def sharding_spec(cls, config: Mapping[str, Any], module: nn.Module,
                      world_size: int) -> ShardingSpec:
        """How this config shards ``module`` over ``world_size`` ranks (see :mod:`mmfsdp.plan`).

        ``shard='node'`` means ``LOCAL_WORLD_SIZE`` ranks (the whole world when unset).
        """
        cfg = FullyShardConfig.from_dict(config)
        policy, _ = cfg.for_model(module)
        local = local_world_size() or world_size
        replicate, shard = cfg.mesh.sizes(world_size, min(local, world_size)
                                          if cfg.mesh.shard == NODE else None)
        reshard = cfg.reshard_after_forward
        return ShardingSpec(
            wrapper='mmfsdp.MMFullyShard', strategy=f'reshard_after_forward={reshard}',
            shard_size=shard, replicate_size=replicate, units=tuple(unit_plan(module, policy)),
            padding=Padding.DIM0 if shard > 1 else Padding.NONE,
            shard_params=shard > 1, shard_grads=shard > 1, shard_optimizer=shard > 1,
            keep_gathered_until_backward=shard > 1 and reshard is not True,
            compute_dtype=cfg.mixed_precision.param_dtype,
            construction=(Construction.SHARDS if cfg.init_device == 'meta'
                          else Construction.FULL))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The sharded model's forward; gradients of the coming backward sync unless in no_sync."""
        for root in self._roots:
            root.set_requires_gradient_sync(self._sync_gradients)
        output = self.module(*args, **kwargs)
        if self._usage_probe is not None and self.training and torch.is_grad_enabled():
            probe, self._usage_probe = self._usage_probe, None
            check_same_parameters_used(probe.remove())
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside accumulate gradients locally in their backward, unreduced.

        Like DDP's ``no_sync``, the setting is taken at forward time and holds
        for that forward's backward, which mmengine runs after the context.
        """
        previous, self._sync_gradients = self._sync_gradients, False
        try:
            yield
        finally:
            self._sync_gradients = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their global norm; return that norm as a plain tensor."""
        return clip_grads_by_global_norm(self, self.parameters(), max_norm, norm_type)
