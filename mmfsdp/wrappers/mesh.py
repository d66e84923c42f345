"""The device mesh of :class:`mmfsdp.MMFullyShard`, from a resolved :class:`MeshSpec`."""
import os
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..options import MeshSpec

__all__ = ['build_mesh', 'check_reshard_after_forward', 'shard_group_size']

#: Dimension names: FSDP2 shards over the last dimension and replicates over the first.
REPLICATE, SHARD = 'replicate', 'shard'


def build_mesh(spec: MeshSpec, device: torch.device) -> DeviceMesh:
    """A 1-D ``('shard',)`` mesh, or 2-D ``('replicate', 'shard')`` for hybrid sharding.

    Collective: every rank of the default process group calls it.
    """
    local = os.environ.get('LOCAL_WORLD_SIZE')
    replicate, shard = spec.sizes(dist.get_world_size(), int(local) if local else None)
    if replicate == 1:
        return init_device_mesh(device.type, (shard, ), mesh_dim_names=(SHARD, ))
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
