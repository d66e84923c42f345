"""Model wrappers registered in :data:`mmfsdp.registry.MODEL_WRAPPERS`.

``base`` holds what they share, ``builder`` goes from ``model_wrapper_cfg`` to
a built wrapper, and each wrapper has its own module with its config.
"""
from .ddp import DDPConfig, MMDistributedDataParallel
from .fsdp import FSDPConfig, MMFullyShardedDataParallel, MMSeparateFullyShardedDataParallel
from .fsdp2 import FullyShardConfig, MMFullyShard

__all__ = ['DDPConfig', 'FSDPConfig', 'FullyShardConfig', 'MMDistributedDataParallel',
           'MMFullyShard', 'MMFullyShardedDataParallel', 'MMSeparateFullyShardedDataParallel']
