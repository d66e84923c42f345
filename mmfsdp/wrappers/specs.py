"""How each sharded wrapper's config shards a model: its :class:`ShardingSpec` for the plan.

Computed from the same resolved config and the same unit choice the wrapper
shards with (:mod:`mmfsdp.plan.spec`), without sharding anything.
"""
from torch import nn
from torch.distributed.fsdp import ShardingStrategy

from ..compat import HYBRID_SHARD_ZERO2
from ..dist import local_world_size
from ..options import NODE, Accumulation
from ..plan.spec import Construction, Padding, ShardingSpec
from ..policies import plan_units
from .config import FSDPConfig, FullyShardConfig
from .mesh import node_mesh_sizes
from .sharding import unit_plan

__all__ = ['fsdp1_spec', 'fully_shard_spec']


def fsdp1_spec(cfg: FSDPConfig, module: nn.Module, world_size: int) -> ShardingSpec:
    """FSDP1: hybrid strategies shard within a node of ``LOCAL_WORLD_SIZE`` ranks (all, unset)."""
    policy, checkpoint_layers = cfg.for_model(module)
    strategy = cfg.sharding_strategy
    shard = world_size
    if strategy is ShardingStrategy.NO_SHARD:
        shard = 1
    elif cfg.hybrid:
        shard = node_mesh_sizes(world_size, local_world_size())[1]
    sharded = shard > 1
    return ShardingSpec(
        wrapper='mmfsdp.MMFullyShardedDataParallel', strategy=strategy.name,
        shard_size=shard, replicate_size=world_size // shard,
        units=tuple(plan_units(module, policy)) if policy else (),
        padding=Padding.FLAT if sharded else Padding.NONE,
        shard_params=sharded, shard_grads=sharded, shard_optimizer=sharded,
        keep_gathered_until_backward=sharded and strategy in (
            ShardingStrategy.SHARD_GRAD_OP, HYBRID_SHARD_ZERO2),
        compute_dtype=cfg.mixed_precision.param_dtype if cfg.mixed_precision else None,
        construction=Construction.UNIT_BY_UNIT, grads_freed_between_steps=True,
        checkpoint_layers=checkpoint_layers,
        unsharded_accumulation=cfg.accumulation is Accumulation.UNSHARDED)


def fully_shard_spec(cfg: FullyShardConfig, module: nn.Module, world_size: int) -> ShardingSpec:
    """FSDP2: ``shard='node'`` means ``LOCAL_WORLD_SIZE`` ranks (the whole world when unset)."""
    policy, checkpoint_layers = cfg.for_model(module)
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
                      else Construction.FULL),
        gathers_unsharded=True, grads_freed_between_steps=True,
        checkpoint_layers=checkpoint_layers,
        unsharded_accumulation=cfg.accumulation is Accumulation.UNSHARDED)

