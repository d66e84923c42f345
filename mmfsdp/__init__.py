"""mmfsdp: sharded (FSDP) and data-parallel (DDP) training in mmengine's workflow.

Importing the package registers the wrappers, ``FSDPRunner``, the hooks, the
optim wrapper and the wrap policies under the scope ``'mmfsdp'``; the demo
workload (``mmfsdp.GPT``, ...) is imported on its first lookup.
"""
# compat first: it checks torch's version before anything touches the newer APIs.
from . import compat, policies  # noqa: F401  (version check, registration)
from .amp import AmpOptimWrapper
from .compat import VERSION as __version__
from .registry import FSDP_WRAP_POLICIES
from .runner import FSDPRunner
from .wrappers import MMDistributedDataParallel, MMFullyShard, MMFullyShardedDataParallel

__all__ = [
    'AmpOptimWrapper', 'FSDPRunner', 'FSDP_WRAP_POLICIES', 'MMDistributedDataParallel',
    'MMFullyShard', 'MMFullyShardedDataParallel', '__version__'
]
