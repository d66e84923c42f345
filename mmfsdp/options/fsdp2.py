"""Options of :class:`mmfsdp.MMFullyShard` (FSDP2, torch's ``fully_shard``)."""
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)

from ..compat import HYBRID_SHARD_ZERO2
from .common import option_dict, resolve_dtypes_and_flags, resolve_flag, suggest
from .fsdp1 import resolve_sharding_strategy

__all__ = ['FSDP1_ONLY_OPTIONS', 'MeshSpec', 'NODE', 'reject_fsdp1_options', 'resolve_init_device',
           'resolve_mesh', 'resolve_mp_policy', 'resolve_offload_policy',
           'resolve_reshard_after_forward', 'translate_sharding_strategy']

#: FSDP1 options that FSDP2 has no use for, and what to write instead. A config
#: moved from ``MMFullyShardedDataParallel`` by changing its ``type`` fails with
#: these messages rather than with a bare "unknown key".
FSDP1_ONLY_OPTIONS: Dict[str, str] = {
    'backward_prefetch': 'FSDP2 always prefetches the next unit in backward; remove it',
    'forward_prefetch': 'FSDP2 prefetches in forward by itself (explicit order: '
                        'set_modules_to_forward_prefetch on the sharded modules); remove it',
    'limit_all_gathers': 'FSDP2 frees all-gather buffers deterministically and needs no rate '
                         'limiter; remove it',
    'use_orig_params': 'FSDP2 always keeps the original parameters (as DTensors); remove it',
    'sync_module_states': "FSDPRunner broadcasts rank 0's weights before sharding (with "
                          "init_device='meta' they come from init_weights or load_from); "
                          'remove it',
    'cpu_offload': 'use offload=dict(cpu_offload=True, pin_memory=True)',
    'device_id': 'the device is chosen by mmfsdp (this process\'s accelerator, else the CPU); '
                 'remove it',
}

#: FSDP1 ``mixed_precision`` keys that ``MixedPrecisionPolicy`` does not have.
_FSDP1_ONLY_MP_KEYS: Dict[str, str] = {
    'buffer_dtype': 'FSDP2 does not cast buffers; they keep the dtype the model gives them',
    'keep_low_precision_grads': 'FSDP2 gives sharded gradients the dtype of the sharded '
                                'parameters; reduce_dtype sets the dtype of the reduction',
    'cast_root_forward_inputs': 'use cast_forward_inputs',
}
_FSDP2_MP_DTYPES = ('param_dtype', 'reduce_dtype', 'output_dtype')
_FSDP2_MP_FLAGS = ('cast_forward_inputs', )

#: ``mesh`` value meaning "the processes of one node" (torchrun's ``LOCAL_WORLD_SIZE``).
NODE = 'node'


def reject_fsdp1_options(cfg: Mapping[str, Any], key: str = 'model_wrapper_cfg') -> None:
    """Raise ``TypeError`` naming the FSDP2 replacement of an FSDP1-only option."""
    for name, instead in FSDP1_ONLY_OPTIONS.items():
        if name in cfg:
            raise TypeError(f'{key}: {name!r} is an FSDP1 option that mmfsdp.MMFullyShard '
                            f'(FSDP2) does not take: {instead}')


def resolve_mp_policy(
        value: Union[Mapping[str, Any], MixedPrecisionPolicy, None]) -> MixedPrecisionPolicy:
    """``mixed_precision``: a dict of ``MixedPrecisionPolicy`` fields, or one.

    ``None`` (or ``{}``) computes and reduces in the parameters' own dtype.

    Example::

        mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32', output_dtype=None,
                             cast_forward_inputs=True)
    """
    if value is None:
        return MixedPrecisionPolicy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, MixedPrecision):
        raise TypeError('model_wrapper_cfg.mixed_precision: '
                        'got an FSDP1 MixedPrecision; FSDP2 takes a '
                        'MixedPrecisionPolicy or dict(param_dtype=..., reduce_dtype=..., '
                        'output_dtype=..., cast_forward_inputs=...)')
    if not isinstance(value, Mapping):
        raise TypeError('model_wrapper_cfg.mixed_precision: '
                        'expected a dict, a MixedPrecisionPolicy or None, '
                        f'got {type(value).__name__} {value!r}')
    for name, instead in _FSDP1_ONLY_MP_KEYS.items():
        if name in value:
            raise TypeError('model_wrapper_cfg.mixed_precision: '
                            f'{name!r} is an FSDP1 key that FSDP2 does not '
                            f'take: {instead}')
    return MixedPrecisionPolicy(**resolve_dtypes_and_flags(
        value, _FSDP2_MP_DTYPES, _FSDP2_MP_FLAGS, 'model_wrapper_cfg.mixed_precision'))


def resolve_offload_policy(value: Union[bool, Mapping[str, Any], OffloadPolicy, None]
                           ) -> OffloadPolicy:
    """``offload``: ``dict(cpu_offload=bool, pin_memory=bool)``, a bool, or an ``OffloadPolicy``.

    ``cpu_offload=True`` keeps sharded parameters, gradients and optimizer
    state on the CPU (``CPUOffloadPolicy``); ``pin_memory`` needs an accelerator.
    """
    if isinstance(value, OffloadPolicy):
        return value
    if value is None or isinstance(value, bool):
        return CPUOffloadPolicy() if value else OffloadPolicy()
    option_dict(value, ('cpu_offload', 'pin_memory'), 'model_wrapper_cfg.offload',
                'dict(cpu_offload=..., pin_memory=...), True/False or an OffloadPolicy')
    pin_memory = resolve_flag(value.get('pin_memory', True), 'model_wrapper_cfg.offload.pin_memory')
    if not resolve_flag(value.get('cpu_offload', False), 'model_wrapper_cfg.offload.cpu_offload'):
        if 'pin_memory' in value:
            raise ValueError('model_wrapper_cfg.offload.pin_memory: '
                             'only applies with cpu_offload=True')
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=pin_memory)


def resolve_reshard_after_forward(value: Union[bool, int]) -> Union[bool, int]:
    """``reshard_after_forward``: ``True`` (ZeRO-3), ``False`` (ZeRO-2) or an int.

    An int ``n`` reshards to groups of ``n`` ranks after forward; it must be a
    divisor of the shard group's size other than 1 and the size itself (checked
    when the mesh exists).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value < 2:
            raise ValueError('model_wrapper_cfg.reshard_after_forward: '
                             f'{value!r} is not a valid group size; '
                             'use True, False or an int >= 2 that divides the shard group size')
        return value
    raise TypeError('model_wrapper_cfg.reshard_after_forward: expected True, False or an int, '
                    f'got {type(value).__name__} {value!r}')


@dataclass(frozen=True)
class MeshSpec:
    """The data-parallel device mesh: ``replicate`` groups of ``shard`` ranks.

    Each size is a positive int, ``-1`` ("the world size divided by the other"),
    or, for ``shard``, ``'node'`` (the processes of one node). ``replicate=1``
    is plain FSDP (a 1-D mesh); ``replicate > 1`` is hybrid sharding (HSDP): a
    2-D mesh ``('replicate', 'shard')``, parameters sharded within a shard
    group and replicated across groups.
    """

    replicate: int = 1
    shard: Union[int, str] = -1

    def sizes(self, world_size: int, local_world_size: Optional[int] = None) -> Tuple[int, int]:
        """``(replicate, shard)`` for ``world_size`` ranks; ``ValueError`` if they do not fit."""
        shard = self.shard
        if shard == NODE:
            if local_world_size is None:
                raise ValueError("model_wrapper_cfg.mesh.shard: "
                                 "'node' needs LOCAL_WORLD_SIZE (set by torchrun); "
                                 'give the shard group size as an int instead')
            shard = local_world_size
        replicate = self.replicate
        if replicate == -1 and shard == -1:
            raise ValueError('model_wrapper_cfg.mesh: replicate and shard cannot both be -1')
        if replicate == -1:
            replicate = world_size // shard if world_size % shard == 0 else 0
        elif shard == -1:
            shard = world_size // replicate if world_size % replicate == 0 else 0
        if replicate * shard != world_size:
            raise ValueError('model_wrapper_cfg.mesh: '
                             f'replicate={self.replicate} x shard={self.shard} does not '
                             f'match the world size {world_size}; replicate * shard must '
                             'equal it (use -1 for "the rest")')
        return replicate, shard


def _mesh_size(value: Any, key: str, allow_node: bool) -> Union[int, str]:
    if allow_node and value == NODE:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        node = f" or '{NODE}' (the processes of one node)" if allow_node else ''
        raise ValueError(f'{key}: expected a positive int, -1 (the rest of the world){node}, '
                         f'got {value!r}')
    return value


def resolve_mesh(value: Union[Mapping[str, Any], MeshSpec, None]) -> MeshSpec:
    """``mesh``: ``dict(replicate=R, shard=S)``; the default shards over every rank."""
    if value is None:
        return MeshSpec()
    if isinstance(value, MeshSpec):
        return value
    option_dict(value, ('replicate', 'shard'), 'model_wrapper_cfg.mesh',
                'dict(replicate=..., shard=...)')
    return MeshSpec(
        replicate=_mesh_size(value.get('replicate', 1), 'model_wrapper_cfg.mesh.replicate', False),
        shard=_mesh_size(value.get('shard', -1), 'model_wrapper_cfg.mesh.shard', True))


def translate_sharding_strategy(value: Union[str, ShardingStrategy]) -> Tuple[bool, bool]:
    """An FSDP1 ``sharding_strategy`` as FSDP2 options: ``(reshard_after_forward, hybrid)``.

    ``FULL_SHARD`` -> ``(True, False)``, ``SHARD_GRAD_OP`` -> ``(False, False)``,
    ``HYBRID_SHARD`` -> ``(True, True)``, ``_HYBRID_SHARD_ZERO2`` -> ``(False, True)``;
    ``hybrid`` asks for a 2-D mesh. ``NO_SHARD`` has no FSDP2 equivalent.
    """
    strategy = resolve_sharding_strategy(value)
    if strategy is ShardingStrategy.NO_SHARD:
        raise ValueError("model_wrapper_cfg.sharding_strategy: "
                         "'NO_SHARD' has no FSDP2 equivalent (FSDP1 itself "
                         "deprecates it for DDP); use type='mmfsdp.MMDistributedDataParallel' "
                         'to replicate without sharding')
    return {
        ShardingStrategy.FULL_SHARD: (True, False),
        ShardingStrategy.SHARD_GRAD_OP: (False, False),
        ShardingStrategy.HYBRID_SHARD: (True, True),
        HYBRID_SHARD_ZERO2: (False, True),
    }[strategy]


def resolve_init_device(value: Optional[str]) -> Optional[str]:
    """``init_device``: ``None`` (build the model on its device) or ``'meta'``."""
    if value is None or value == 'meta':
        return value
    raise ValueError('model_wrapper_cfg.init_device: '
                     f'{value!r} is not supported{suggest(value, ["meta"])}; '
                     "valid choices are None (build the full model, then shard) and 'meta' "
                     '(build on the meta device, shard, then materialise each shard)')
