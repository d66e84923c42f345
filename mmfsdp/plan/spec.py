"""What a wrapper will do with a model, without doing it: the input of the memory plan.

:func:`sharding_spec` derives a :class:`ShardingSpec` from a resolved wrapper
config and its layout; the plan (:mod:`.memory`) and the ranks' agreement
(:func:`mmfsdp.agreement.fingerprint`) read it. The wrappers themselves never do.
"""
import enum
from dataclasses import dataclass, replace
from typing import Optional, Tuple, Type

import torch
from torch import nn
from torch.distributed.fsdp import ShardingStrategy

from .. import policies
from ..compat import HYBRID_SHARD_ZERO2
from ..dist import local_world_size
from ..options import Accumulation
from ..wrappers.base import NODE, Layout, MeshSpec, WrapperConfig, units_children_first
from ..wrappers.fsdp import FSDPConfig
from ..wrappers.fsdp2 import FullyShardConfig


class Padding(enum.Enum):
    """How a unit's parameters are split over the ranks of its shard group."""

    #: FSDP1: the unit's parameters are flattened into one vector, padded to a
    #: multiple of the group size and split evenly.
    FLAT = 'flat'
    #: FSDP2: every parameter is split along dim 0, padded to a multiple of
    #: the group size.
    DIM0 = 'dim0'
    #: Not split (DDP, NO_SHARD).
    NONE = 'none'


class Construction(enum.Enum):
    """Where the model's weights live while the wrapper builds it: bounds the construction peak."""

    #: The full model on the device, then sharded (DDP; FSDP2 without meta init).
    FULL = 'full model on the device, then sharded'
    #: The full model on the CPU; FSDP1 moves it to the device unit by unit
    #: (the device holds the shards, one unit and its flat copy).
    UNIT_BY_UNIT = 'full model on the CPU, moved to the device unit by unit'
    #: Built on the meta device; each rank allocates only its shards (FSDP2 meta init).
    SHARDS = 'meta init: only the shards are allocated'


@dataclass(frozen=True)
class ShardingSpec:
    """A wrapper's sharding of one model at one world size.

    Parameters, gradients and optimizer states are split over ``shard_size``
    ranks when it is above 1.
    """

    #: The wrapper's registered name, e.g. ``'mmfsdp.MMFullyShardedDataParallel'``.
    wrapper: str
    #: The strategy in the wrapper's own words, e.g. ``'FULL_SHARD'``.
    strategy: str
    #: Ranks that hold different shards of one unit (the ``shard`` mesh dim).
    shard_size: int
    #: Ranks that hold the same shard (the ``replicate`` mesh dim).
    replicate_size: int
    #: The units' module names, children before parents; the root is implied.
    units: Tuple[str, ...] = ()
    padding: Padding = Padding.NONE
    #: Whether gathered parameters stay unsharded from forward until backward
    #: (SHARD_GRAD_OP, ``reshard_after_forward=False``): adds them to the peak.
    keep_gathered_until_backward: bool = False
    #: ``reshard_after_forward=<int>``: between forward and backward the gathered
    #: parameters stay sharded over this many ranks (1: not resharded at all).
    kept_shard_size: int = 1
    #: dtype of the gathered parameters used in compute (mixed precision), or
    #: ``None`` for the parameters' own dtype.
    compute_dtype: Optional[torch.dtype] = None
    #: How the wrapper builds the model (see :class:`Construction`).
    construction: Construction = Construction.FULL
    #: Whether the wrapper all-gathers into unsharded parameters even when
    #: ``shard_size`` is 1 (FSDP2 does; FSDP1 then computes on its shards).
    gathers_unsharded: bool = False
    #: Whether gradients are freed between steps: ``optimizer.zero_grad()`` sets
    #: them to ``None`` (FSDP2's DTensor gradients; FSDP1 then drops its flat
    #: gradient at the next forward), so they exist only from backward to the
    #: optimizer step. DDP's buckets stay allocated.
    grads_freed_between_steps: bool = False
    #: Layer classes wrapped in activation checkpointing (``activation_checkpointing``).
    checkpoint_layers: Tuple[Type[nn.Module], ...] = ()
    #: Whether gradient accumulation keeps full, unsharded gradients between
    #: micro-steps (``accumulation='unsharded'``) instead of the gradient shard.
    unsharded_accumulation: bool = False
    #: Units (also in :attr:`units`) that compute in fp32 under mixed precision
    #: (``mixed_precision.fp32_modules``): gathered in their parameters' dtype.
    fp32_units: Tuple[str, ...] = ()
    #: Why ``auto_wrap_policy='auto'`` chose the units (``''``: it did not choose them).
    auto_units: str = ''


def sharding_spec(config: WrapperConfig, layout: Layout, world_size: int) -> ShardingSpec:
    """How ``config`` shards the model of ``layout`` over ``world_size`` ranks.

    DDP (and any other config) replicates on every rank. FSDP2's ``shard='node'``
    and FSDP1's hybrid strategies shard within a node of ``LOCAL_WORLD_SIZE``
    ranks (the whole world when it is unset).
    """
    local = local_world_size() or world_size
    spec = ShardingSpec(
        wrapper=config.NAME, strategy='REPLICATE', shard_size=1, replicate_size=world_size,
        units=units_children_first(layout.units, layout.fp32_modules),
        fp32_units=layout.fp32_modules, compute_dtype=config.compute_dtype,
        checkpoint_layers=layout.checkpoint_layers,
        auto_units=(layout.policy.keywords['chosen']
                    if getattr(layout.policy, 'func', None) is policies.auto else ''),
        unsharded_accumulation=config.accumulation is Accumulation.UNSHARDED)
    if isinstance(config, FullyShardConfig):
        replicate, shard = config.mesh.sizes(world_size, local)
        reshard = config.reshard_after_forward
        return replace(
            spec, strategy=f'reshard_after_forward={reshard}', shard_size=shard,
            replicate_size=replicate, padding=Padding.DIM0 if shard > 1 else Padding.NONE,
            keep_gathered_until_backward=shard > 1 and reshard is not True,
            kept_shard_size=reshard if type(reshard) is int else 1,
            construction=Construction.SHARDS if config.init_device == 'meta'
            else Construction.FULL,
            gathers_unsharded=True, grads_freed_between_steps=True)
    if isinstance(config, FSDPConfig):
        strategy = config.sharding_strategy
        shard = 1 if strategy is ShardingStrategy.NO_SHARD else world_size
        if config.hybrid:  # FSDP1's hybrid strategies: shard within a node
            shard = MeshSpec(replicate=-1, shard=NODE).sizes(world_size, local)[1]
        return replace(
            spec, strategy=strategy.name, shard_size=shard, replicate_size=world_size // shard,
            padding=Padding.FLAT if shard > 1 else Padding.NONE,
            keep_gathered_until_backward=shard > 1 and strategy in (
                ShardingStrategy.SHARD_GRAD_OP, HYBRID_SHARD_ZERO2),
            construction=Construction.UNIT_BY_UNIT, grads_freed_between_steps=True)
    return spec
