"""mmfsdp: sharded (FSDP) and data-parallel (DDP) training in mmengine's workflow.

Importing the package registers everything: the wrappers, ``FSDPRunner``,
the wrap policies and the demo workload, each under the scope ``'mmfsdp'``.
"""
from . import demo, policies  # noqa: F401  (registration)
from .amp import AmpOptimWrapper
from .registry import FSDP_WRAP_POLICIES
from .runner import FSDPRunner
from .wrappers import MMDistributedDataParallel, MMFullyShard, MMFullyShardedDataParallel

__version__ = '0.1.0'

__all__ = [
    'AmpOptimWrapper', 'FSDPRunner', 'FSDP_WRAP_POLICIES', 'MMDistributedDataParallel',
    'MMFullyShard', 'MMFullyShardedDataParallel', '__version__'
]
