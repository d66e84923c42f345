"""What a wrapper will do with a model: the input of every memory plan.

Each mmfsdp wrapper describes its sharding with a :class:`ShardingSpec`
(classmethod ``sharding_spec(config, module, world_size)``), computed from the
same resolved config and the same wrap policy it shards with, so a plan can
never disagree with what the wrapper builds.
"""
import enum
from dataclasses import dataclass
from typing import Optional, Tuple, Type

import torch
from torch import nn

__all__ = ['Construction', 'Padding', 'ShardingSpec']


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
    """A wrapper's sharding of one model at one world size."""

    #: The wrapper's registered name, e.g. ``'mmfsdp.MMFullyShardedDataParallel'``.
    wrapper: str
    #: The strategy in the wrapper's own words, e.g. ``'FULL_SHARD'``.
    strategy: str
    #: Ranks that hold different shards of one unit (the ``shard`` mesh dim).
    shard_size: int
    #: Ranks that hold the same shard (the ``replicate`` mesh dim).
    replicate_size: int
    #: The units' module names, children before parents; the root is implied.
    units: Tuple[str, ...]
    padding: Padding
    #: Whether parameters / gradients / optimizer states are split over ``shard_size``.
    shard_params: bool
    shard_grads: bool
    shard_optimizer: bool
    #: Whether gathered parameters stay unsharded from forward until backward
    #: (SHARD_GRAD_OP, ``reshard_after_forward=False``): adds them to the peak.
    keep_gathered_until_backward: bool = False
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
