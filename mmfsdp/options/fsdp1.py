"""Options of :class:`mmfsdp.MMFullyShardedDataParallel` (FSDP1)."""
from typing import Any, Mapping, Optional, Union

from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

from .common import check_keys, resolve_dtypes_and_flags, resolve_enum, resolve_flag

__all__ = ['resolve_backward_prefetch', 'resolve_cpu_offload', 'resolve_mixed_precision',
           'resolve_sharding_strategy']

#: ``mixed_precision`` keys of FSDP1 and their kind: dtype or flag.
_FSDP1_MP_DTYPES = ('param_dtype', 'reduce_dtype', 'buffer_dtype')
_FSDP1_MP_FLAGS = ('keep_low_precision_grads', 'cast_forward_inputs', 'cast_root_forward_inputs')

_BACKWARD_PREFETCH_ALIASES = {
    'pre': BackwardPrefetch.BACKWARD_PRE,
    'post': BackwardPrefetch.BACKWARD_POST,
}


def resolve_sharding_strategy(value: Union[str, ShardingStrategy]) -> ShardingStrategy:
    """``sharding_strategy``: any ``ShardingStrategy`` name, case-insensitive."""
    return resolve_enum(value, ShardingStrategy, 'model_wrapper_cfg.sharding_strategy')


def resolve_backward_prefetch(
        value: Union[str, BackwardPrefetch, None]) -> Optional[BackwardPrefetch]:
    """``backward_prefetch``: ``'pre' | 'post' | None`` or a ``BackwardPrefetch``."""
    if value is None:
        return None
    return resolve_enum(value, BackwardPrefetch, 'model_wrapper_cfg.backward_prefetch',
                        _BACKWARD_PREFETCH_ALIASES)


def resolve_mixed_precision(
        value: Union[Mapping[str, Any], MixedPrecision, None]) -> Optional[MixedPrecision]:
    """``mixed_precision``: a dict of FSDP1 ``MixedPrecision`` fields, or one.

    Example::

        mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32')
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    if not isinstance(value, Mapping):
        raise TypeError('model_wrapper_cfg.mixed_precision: '
                        'expected a dict, a MixedPrecision or None, '
                        f'got {type(value).__name__} {value!r}')
    return MixedPrecision(**resolve_dtypes_and_flags(value, _FSDP1_MP_DTYPES, _FSDP1_MP_FLAGS,
                                                     'model_wrapper_cfg.mixed_precision'))


def resolve_cpu_offload(value: Union[bool, Mapping[str, Any], CPUOffload]) -> CPUOffload:
    """``cpu_offload``: ``bool``, ``dict(offload_params=...)`` or a ``CPUOffload``."""
    if isinstance(value, CPUOffload):
        return value
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    if isinstance(value, Mapping):
        check_keys(value, ('offload_params', ), 'model_wrapper_cfg.cpu_offload')
        return CPUOffload(offload_params=resolve_flag(
            value.get('offload_params', False), 'model_wrapper_cfg.cpu_offload.offload_params'))
    raise TypeError('model_wrapper_cfg.cpu_offload: '
                    'expected True/False, dict(offload_params=...) or a '
                    f'CPUOffload, got {type(value).__name__} {value!r}')
