"""Device meshes of the sharded wrappers.

:class:`mmfsdp.MMFullyShard`'s from a resolved :class:`MeshSpec`, and the
``(replicate, shard)`` mesh of FSDP1's hybrid strategies (one shard group per node).
"""
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..dist import local_world_size
from ..options import MeshSpec

__all__ = ['build_hybrid_mesh', 'build_mesh', 'check_reshard_after_forward', 'node_mesh_sizes',
           'shard_group_size']

#: Dimension names: FSDP2 shards over the last dimension and replicates over the first.
REPLICATE, SHARD = 'replicate', 'shard'


def build_mesh(spec: MeshSpec, device: torch.device) -> DeviceMesh:
    """A 1-D ``('shard',)`` mesh, or 2-D ``('replicate', 'shard')`` for hybrid sharding.

    Collective: every rank of the default process group calls it.
    """
    replicate, shard = spec.sizes(dist.get_world_size(), local_world_size())
    if replicate == 1:
        return init_device_mesh(device.type, (shard, ), mesh_dim_names=(SHARD, ))
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=(REPLICATE, SHARD))


def node_mesh_sizes(world_size: int, local: Optional[int]) -> Tuple[int, int]:
    """``(replicate, shard)`` for sharding within each node of ``local`` ranks.

    ``local`` is ``LOCAL_WORLD_SIZE`` (``None``: one node holds the whole world).
    """
    shard = min(world_size, local or world_size)
    if world_size % shard:
        raise ValueError(f'LOCAL_WORLD_SIZE: {shard} ranks per node do not divide the world '
                         f'size {world_size}; hybrid sharding needs the same number of ranks '
                         'on every node')
    return world_size // shard, shard


def build_hybrid_mesh(device: torch.device) -> DeviceMesh:
    """The 2-D ``('replicate', 'shard')`` mesh of FSDP1's hybrid strategies: shard within a node.

    Collective: every rank of the default process group calls it.
    """
    replicate, shard = node_mesh_sizes(dist.get_world_size(), local_world_size())
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=(REPLICATE, SHARD))


def shard_group_size(mesh: DeviceMesh) -> int:
    """How many ranks one parameter is sharded over."""
    return mesh.size(mesh.ndim - 1)


def check_reshard_after_forward(value: Union[bool, int], mesh: DeviceMesh) -> None:
    """An int ``reshard_after_forward`` must divide the shard group size (1 and itself excluded)."""
    if isinstance(value, bool):
        return
    size = shard_group_size(mesh)
    if value >= size or size % value:
        divisors = [d for d in range(2, size) if size % d == 0]
        raise ValueError('model_wrapper_cfg.reshard_after_forward: '
                         f'{value} is not a divisor of the shard group '
                         f'size {size} other than 1 and {size}; valid ints here are {divisors} '
                         '(or use True / False)')
