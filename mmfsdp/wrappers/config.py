"""The resolved configurations of the sharded wrappers, on one base.

:class:`WrapperConfig` holds what FSDP1's :class:`FSDPConfig` and FSDP2's
:class:`FullyShardConfig` share: :meth:`~WrapperConfig.from_dict` turns a
``model_wrapper_cfg`` into typed values through the class's resolver table
(one resolver per option; options without one, the model-dependent ones, stay
as written), :meth:`~WrapperConfig.for_model` checks those against the model,
and :meth:`~WrapperConfig.check` is the whole check a runner makes before any
collective. Each subclass adds its fields, its table and the device check.
"""
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple, Type, Union

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)

from ..activation_checkpointing import resolve_activation_checkpointing
from ..compat import HYBRID_SHARD_ZERO2
from ..dist import current_device
from ..options import (
    Accumulation,
    MeshSpec,
    check_keys,
    reject_fsdp1_options,
    resolve_accumulation,
    resolve_backward_prefetch,
    resolve_cpu_offload,
    resolve_flag,
    resolve_init_device,
    resolve_mesh,
    resolve_mixed_precision,
    resolve_mp_policy,
    resolve_offload_policy,
    resolve_reshard_after_forward,
    resolve_sharding_strategy,
    translate_sharding_strategy,
)
from ..policies import PolicyConfig, WrapPolicy, build_wrap_policy
from .separate import separate_roots
from .steps import own_steps

__all__ = ['FSDPConfig', 'FullyShardConfig', 'WrapperConfig']

Resolver = Callable[[Any], Any]


def _as_is(value: Any) -> Any:
    return value


def _flag(key: str) -> Resolver:
    return functools.partial(resolve_flag, key=f'model_wrapper_cfg.{key}')


class WrapperConfig:
    """Base of the resolved wrapper configs (frozen dataclasses).

    Subclasses declare ``auto_wrap_policy``, ``activation_checkpointing`` and
    ``init_device`` among their fields, and set :attr:`RESOLVERS`.
    """

    #: ``option -> resolver`` (raising on bad input); options without one are kept as written.
    RESOLVERS: ClassVar[Mapping[str, Resolver]] = {}
    #: Keys accepted besides the fields, turned into fields by :meth:`_translate`.
    TRANSLATED: ClassVar[Tuple[str, ...]] = ()

    auto_wrap_policy: PolicyConfig
    activation_checkpointing: Optional[Mapping[str, Any]]
    init_device: Optional[str]

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> Any:
        """Resolve a ``model_wrapper_cfg`` (without ``type``), raising on bad input."""
        check_keys(cfg, [f.name for f in fields(cls)] + list(cls.TRANSLATED), 'model_wrapper_cfg')
        options = cls._translate(dict(cfg))
        return cls(**{name: cls.RESOLVERS.get(name, _as_is)(value)
                      for name, value in options.items()})

    @classmethod
    def _translate(cls, cfg: Dict[str, Any]) -> Dict[str, Any]:
        """``cfg`` (a copy) with the :attr:`TRANSLATED` keys turned into fields."""
        return cfg

    def for_model(self, module: nn.Module) -> Tuple[Optional[WrapPolicy], Tuple[Type[nn.Module],
                                                                                ...]]:
        """The wrap policy and the checkpointed layer classes, checked against ``module``."""
        return (build_wrap_policy(self.auto_wrap_policy, module),
                resolve_activation_checkpointing(self.activation_checkpointing, module))

    def check_device(self, device: torch.device) -> None:
        """Raise on options the training device cannot honour."""

    @property
    def offloads_to_cpu(self) -> bool:
        """Whether the parameters stay on the CPU while training."""
        raise NotImplementedError

    @classmethod
    def check(cls, config: Mapping[str, Any], module: Optional[nn.Module],
              wrapper_name: str) -> None:
        """Raise on a bad config; with ``module``, check the model-dependent options too.

        What a wrapper's ``check_config`` does (:class:`mmfsdp.protocol.ParallelWrapper`):
        lets a runner reject a config on every rank before any collective.
        """
        cfg = cls.from_dict(config)
        cfg.check_device(current_device())
        if module is not None:
            cfg.for_model(module)
            if own_steps(module):
                separate_roots(module, wrapper_name)


@dataclass(frozen=True)
class FSDPConfig(WrapperConfig):
    """The configuration of :class:`mmfsdp.MMFullyShardedDataParallel`, resolved."""

    #: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD, HYBRID_SHARD, ...
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    #: Which submodules become their own unit (see :mod:`mmfsdp.policies`).
    auto_wrap_policy: PolicyConfig = None
    #: When to fetch the next unit's parameters in backward.
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    #: Compute / reduce / buffer dtypes; ``None`` trains in the parameters' dtype.
    mixed_precision: Optional[MixedPrecision] = None
    #: Keep sharded parameters and gradients on the CPU.
    cpu_offload: CPUOffload = field(default_factory=CPUOffload)
    #: ``dict(layer_cls=[...])``: layers whose activations are recomputed in backward.
    activation_checkpointing: Optional[Mapping[str, Any]] = None
    #: Fetch the next unit's parameters during forward, ahead of its use.
    forward_prefetch: bool = False
    #: Bound the number of all-gathers in flight (caps memory on accelerators).
    limit_all_gathers: bool = True
    #: Broadcast rank 0's weights at construction, unit by unit on the device.
    #: FSDPRunner turns it on where it keeps the model on the CPU until wrapping.
    sync_module_states: bool = False
    #: ``'meta'``: build on the meta device; the model is materialised and
    #: initialised on the CPU, then moved to the device unit by unit.
    init_device: Optional[str] = None
    #: Gradient accumulation: ``'sharded'`` reduce-scatters every micro-step,
    #: ``'unsharded'`` keeps full local gradients until the last (``no_sync``);
    #: see :mod:`mmfsdp.options.accumulation`.
    accumulation: Accumulation = Accumulation.SHARDED

    RESOLVERS: ClassVar[Mapping[str, Resolver]] = dict(
        sharding_strategy=resolve_sharding_strategy,
        backward_prefetch=resolve_backward_prefetch,
        mixed_precision=resolve_mixed_precision,
        cpu_offload=resolve_cpu_offload,
        forward_prefetch=_flag('forward_prefetch'),
        limit_all_gathers=_flag('limit_all_gathers'),
        sync_module_states=_flag('sync_module_states'),
        init_device=resolve_init_device,
        accumulation=resolve_accumulation,
    )

    @property
    def offloads_to_cpu(self) -> bool:
        """``cpu_offload``."""
        return self.cpu_offload.offload_params

    @property
    def hybrid(self) -> bool:
        """Whether the strategy replicates across nodes and shards within each."""
        return self.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, HYBRID_SHARD_ZERO2)

    def check_device(self, device: torch.device) -> None:
        """Raise on options the training device cannot honour.

        FSDP1 offloads into pinned memory, which needs an accelerator: on the
        CPU it would fail inside torch at the first forward.
        """
        if self.cpu_offload.offload_params and device.type == 'cpu':
            raise ValueError('model_wrapper_cfg.cpu_offload: FSDP1 offloads to pinned memory, '
                             'which needs an accelerator, and this process trains on the CPU; '
                             'set cpu_offload=False (the parameters are on the CPU already)')


@dataclass(frozen=True)
class FullyShardConfig(WrapperConfig):
    """The configuration of :class:`mmfsdp.MMFullyShard`, resolved.

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
    #: Gradient accumulation: ``'sharded'`` reduce-scatters every micro-step,
    #: ``'unsharded'`` keeps full local gradients until the last (``no_sync``) and, with
    #: ``reshard_after_forward=False``, the gathered parameters too;
    #: see :mod:`mmfsdp.options.accumulation`.
    accumulation: Accumulation = Accumulation.SHARDED

    RESOLVERS: ClassVar[Mapping[str, Resolver]] = dict(
        reshard_after_forward=resolve_reshard_after_forward,
        mesh=resolve_mesh,
        mixed_precision=resolve_mp_policy,
        offload=resolve_offload_policy,
        init_device=resolve_init_device,
        find_unused_parameters=_flag('find_unused_parameters'),
        accumulation=resolve_accumulation,
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
        return cfg

    @property
    def offloads_to_cpu(self) -> bool:
        """``offload=dict(cpu_offload=True)``."""
        return isinstance(self.offload, CPUOffloadPolicy)

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
