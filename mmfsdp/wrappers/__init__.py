"""Model wrappers registered in :data:`mmfsdp.registry.MODEL_WRAPPERS`."""
from .ddp import MMDistributedDataParallel
from .fsdp import FSDPConfig, MMFullyShardedDataParallel

__all__ = ['FSDPConfig', 'MMDistributedDataParallel', 'MMFullyShardedDataParallel']
