"""mmfsdp: sharded (FSDP) and data-parallel (DDP) training in mmengine's workflow.

Importing the package registers everything: the wrappers, ``FSDPRunner``,
the wrap policies and the demo workload, each under the scope ``'mmfsdp'``.
"""
# compat first: it checks torch's version before anything touches the newer APIs.
from . import compat, demo, policies  # noqa: F401  (version check, registration)
from .amp import AmpOptimWrapper
from .registry import FSDP_WRAP_POLICIES
from .release import __version__
from .runner import FSDPRunner
from .wrappers import MMDistributedDataParallel, MMFullyShard, MMFullyShardedDataParallel

__all__ = [
    'AmpOptimWrapper', 'FSDPRunner', 'FSDP_WRAP_POLICIES', 'MMDistributedDataParallel',
    'MMFullyShard', 'MMFullyShardedDataParallel', '__version__'
]
