"""Model wrappers registered in :data:`mmfsdp.registry.MODEL_WRAPPERS`."""
from .ddp import MMDistributedDataParallel
from .fsdp import FSDPConfig, MMFullyShardedDataParallel
from .fsdp2 import FullyShardConfig, MMFullyShard

__all__ = ['FSDPConfig', 'FullyShardConfig', 'MMDistributedDataParallel', 'MMFullyShard',
           'MMFullyShardedDataParallel']
