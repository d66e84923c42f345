"""Turn the strings of a config into torch values, in one place.

Every option of every wrapper that a user can write as a string is resolved
here, once, at the edge: the wrappers only ever see ``torch.dtype``, enum
members and dataclasses. Each resolver names the config key, the bad value and
the valid choices in its error, so that a typo fails on every rank at once,
before any collective, instead of hanging or training the wrong thing.

Errors follow one convention: ``TypeError`` for a value of the wrong type or an
unknown keyword, ``ValueError`` for a value outside the valid choices.

- :mod:`.common`: dtypes, enums, flags, keys, module classes by name;
- :mod:`.fsdp1`: ``MMFullyShardedDataParallel``'s strategy, prefetch, precision, offload;
- :mod:`.fsdp2`: ``MMFullyShard``'s precision policy, offload, mesh, resharding;
- :mod:`.accumulation`: both sharded wrappers' gradient accumulation mode.
"""
from .accumulation import Accumulation, resolve_accumulation
from .common import (
    check_keys,
    resolve_dtype,
    resolve_enum,
    resolve_flag,
    resolve_module_classes,
    suggest,
    wrapper_options,
)
from .fsdp1 import (
    resolve_backward_prefetch,
    resolve_cpu_offload,
    resolve_mixed_precision,
    resolve_sharding_strategy,
)
from .fsdp2 import (
    FSDP1_ONLY_OPTIONS,
    NODE,
    MeshSpec,
    reject_fsdp1_options,
    resolve_init_device,
    resolve_mesh,
    resolve_mp_policy,
    resolve_offload_policy,
    resolve_reshard_after_forward,
    translate_sharding_strategy,
)

__all__ = [
    'Accumulation', 'resolve_accumulation',
    'check_keys', 'resolve_backward_prefetch', 'resolve_cpu_offload', 'resolve_dtype',
    'resolve_enum', 'resolve_flag', 'resolve_mixed_precision', 'resolve_module_classes',
    'resolve_sharding_strategy', 'suggest', 'wrapper_options', 'FSDP1_ONLY_OPTIONS', 'MeshSpec',
    'NODE', 'reject_fsdp1_options', 'resolve_init_device', 'resolve_mesh', 'resolve_mp_policy',
    'resolve_offload_policy', 'resolve_reshard_after_forward', 'translate_sharding_strategy'
]
