"""``MMFullyShardedDataParallel``: torch's FSDP1 for mmengine models."""
import functools
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)

from ..activation_checkpointing import (
    apply_activation_checkpointing_to,
    resolve_activation_checkpointing,
)
from ..dist import current_device, local_world_size
from ..meta_init import check_init_cfgs, materialize, set_preprocessor_device
from ..options import (
    check_keys,
    resolve_backward_prefetch,
    resolve_cpu_offload,
    resolve_flag,
    resolve_init_device,
    resolve_mixed_precision,
    resolve_sharding_strategy,
)
from ..plan.spec import Construction, Padding, ShardingSpec
from ..policies import PolicyConfig, WrapPolicy, build_wrap_policy, plan_units
from ..registry import MODEL_WRAPPERS
from .guard import reject_stock_runner
from .mesh import build_hybrid_mesh, node_mesh_sizes
from .separate import MMSeparateFullyShardedDataParallel, separate_roots
from .steps import DataParallelSteps, own_steps

__all__ = ['FSDPConfig', 'MMFullyShardedDataParallel']


@dataclass(frozen=True)
class FSDPConfig:
    """The configuration of :class:`MMFullyShardedDataParallel`, resolved.

    :meth:`from_dict` turns the user's strings into these typed values; the
    two model-dependent options stay as written until :meth:`for_model`
    checks them against the model.
    """

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

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> 'FSDPConfig':
        """Resolve a ``model_wrapper_cfg`` (without ``type``), raising on bad input."""
        check_keys(cfg, [f.name for f in fields(cls)], 'model_wrapper_cfg')
        return cls(**{name: _RESOLVERS.get(name, _as_is)(value)
                      for name, value in cfg.items()})

    def for_model(self, module: nn.Module) -> Tuple[Optional[WrapPolicy], Tuple[Type[nn.Module],
                                                                                ...]]:
        """The wrap policy and the checkpointed layer classes, checked against ``module``."""
        return (build_wrap_policy(self.auto_wrap_policy, module),
                resolve_activation_checkpointing(self.activation_checkpointing, module))

    def check_device(self, device: torch.device) -> None:
        """Raise on options the training device cannot honour.

        FSDP1 offloads into pinned memory, which needs an accelerator: on the
        CPU it would fail inside torch at the first forward.
        """
        if self.cpu_offload.offload_params and device.type == 'cpu':
            raise ValueError('model_wrapper_cfg.cpu_offload: FSDP1 offloads to pinned memory, '
                             'which needs an accelerator, and this process trains on the CPU; '
                             'set cpu_offload=False (the parameters are on the CPU already)')


def _as_is(value: Any) -> Any:
    return value


_RESOLVERS: Dict[str, Callable[[Any], Any]] = dict(
    sharding_strategy=resolve_sharding_strategy,
    backward_prefetch=resolve_backward_prefetch,
    mixed_precision=resolve_mixed_precision,
    cpu_offload=resolve_cpu_offload,
    forward_prefetch=functools.partial(resolve_flag, key='model_wrapper_cfg.forward_prefetch'),
    limit_all_gathers=functools.partial(resolve_flag, key='model_wrapper_cfg.limit_all_gathers'),
    sync_module_states=functools.partial(resolve_flag, key='model_wrapper_cfg.sync_module_states'),
    init_device=resolve_init_device,
)


def _is_hybrid(strategy: ShardingStrategy) -> bool:
    return strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@MODEL_WRAPPERS.register_module()
class MMFullyShardedDataParallel(DataParallelSteps, FullyShardedDataParallel):
    """Fully sharded data parallel (FSDP1) with mmengine's step interface.

    The keyword arguments are the fields of :class:`FSDPConfig`. The device is
    this process's accelerator or the CPU (chosen here, not configured).
    Parameters keep their names and objects (``use_orig_params=True``), which
    per-parameter optimizer settings (``paramwise_cfg``) rely on.

    Build it through :class:`mmfsdp.FSDPRunner`, which initialises weights on
    the full model before sharding, groups parameters by their unsharded
    shapes and clips by the global norm; mmengine's stock Runner is refused.

    The device never holds the full model: the model stays on the CPU until
    wrapping and FSDP moves it to the device unit by unit (``device_id``),
    with rank 0's weights broadcast per unit on the device. With
    ``init_device='meta'`` the model is built on the meta device and
    materialised on the CPU with the verified init of :mod:`mmfsdp.meta_init`.

    Config::

        runner_type = 'mmfsdp.FSDPRunner'
        model_wrapper_cfg = dict(
            type='mmfsdp.MMFullyShardedDataParallel',
            sharding_strategy='FULL_SHARD',        # any ShardingStrategy name
            auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
            backward_prefetch='pre',               # 'pre' | 'post' | None
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32'),
            cpu_offload=False,
            activation_checkpointing=dict(layer_cls=['TransformerBlock']),
            init_device=None)                      # 'meta': build without weights first
    """

    #: :class:`mmfsdp.FSDPRunner` may build the model on the meta device for it.
    supports_meta_init = True

    def __new__(cls, module: Optional[nn.Module] = None, **config: Any) -> nn.Module:
        """A new wrapper; for a model with its own steps, one FSDP1 root per child.

        FSDP1 reduces gradients only after a backward through its root's
        forward, which a model's own ``train_step`` never runs (see
        :mod:`mmfsdp.wrappers.separate`).
        """
        if module is not None and own_steps(module) and cls is MMFullyShardedDataParallel:
            reject_stock_runner(cls.__name__)
            return MMSeparateFullyShardedDataParallel(module, **config)
        return super().__new__(cls)

    def __init__(self, module: nn.Module, **config: Any) -> None:
        reject_stock_runner(type(self).__name__)
        cfg = FSDPConfig.from_dict(config)
        device = current_device()
        cfg.check_device(device)
        policy, checkpoint_layers = cfg.for_model(module)
        on_meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
        if on_meta and cfg.init_device != 'meta':
            raise ValueError("the model is on the meta device; set init_device='meta' in the "
                             'wrapper config to materialise it before sharding')
        if on_meta:
            check_init_cfgs(module)
            # On the CPU, then to the device unit by unit: FSDP1 flattens whole
            # tensors, so shape-dependent initialisers need them unsharded.
            materialize(module, torch.device('cpu'),
                        broadcast='all' if device.type == 'cpu' else None)
        # A 2-D mesh, not FSDP1's own intra-node groups: with it the sharded state
        # dicts are DTensors over the whole world, so a DCP save covers every rank
        # (without it they cover one node's group only, torch #102904).
        mesh = build_hybrid_mesh(device) if _is_hybrid(cfg.sharding_strategy) else None
        super().__init__(
            module,
            sharding_strategy=cfg.sharding_strategy,
            auto_wrap_policy=policy,
            backward_prefetch=cfg.backward_prefetch,
            mixed_precision=cfg.mixed_precision,
            cpu_offload=cfg.cpu_offload,
            device_id=device,
            device_mesh=mesh,
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=cfg.limit_all_gathers,
            # FSDP1 broadcasts only tensors on an accelerator; on the CPU materialize() did
            sync_module_states=cfg.sync_module_states or (on_meta and device.type != 'cpu'),
            use_orig_params=True)
        set_preprocessor_device(self.module, device)
        apply_activation_checkpointing_to(self, checkpoint_layers)

    @classmethod
    def check_config(cls, config: Mapping[str, Any], module: Optional[nn.Module] = None) -> None:
        """Raise on a bad config; with ``module``, check the model-dependent options too.

        Lets a runner reject a config on every rank before any collective.
        """
        cfg = FSDPConfig.from_dict(config)
        cfg.check_device(current_device())
        if module is not None:
            cfg.for_model(module)
            if own_steps(module):
                separate_roots(module, 'mmfsdp.MMFullyShardedDataParallel')

    @classmethod
    def offloads_to_cpu(cls, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` keeps the parameters on the CPU (``cpu_offload``)."""
        return FSDPConfig.from_dict(config).cpu_offload.offload_params

    @classmethod
    def sharding_spec(cls, config: Mapping[str, Any], module: nn.Module,
                      world_size: int) -> ShardingSpec:
        """How this config shards ``module`` over ``world_size`` ranks (see :mod:`mmfsdp.plan`).

        Hybrid strategies shard within a node of ``LOCAL_WORLD_SIZE`` ranks
        (the whole world when unset).
        """
        cfg = FSDPConfig.from_dict(config)
        policy, _ = cfg.for_model(module)
        strategy = cfg.sharding_strategy
        shard = world_size
        if strategy is ShardingStrategy.NO_SHARD:
            shard = 1
        elif _is_hybrid(strategy):
            shard = node_mesh_sizes(world_size, local_world_size())[1]
        sharded = shard > 1
        return ShardingSpec(
            wrapper='mmfsdp.MMFullyShardedDataParallel', strategy=strategy.name,
            shard_size=shard, replicate_size=world_size // shard,
            units=tuple(plan_units(module, policy)) if policy else (),
            padding=Padding.FLAT if sharded else Padding.NONE,
            shard_params=sharded, shard_grads=sharded, shard_optimizer=sharded,
            keep_gathered_until_backward=sharded and strategy in (
                ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2),
            compute_dtype=cfg.mixed_precision.param_dtype if cfg.mixed_precision else None,
            construction=Construction.UNIT_BY_UNIT)
