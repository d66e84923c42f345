"""The wrapper protocol now lives in :mod:`mmfsdp.wrappers.base`."""
from .wrappers.base import ModelBinding, ParallelWrapper, is_parallel_wrapper

__all__ = ['ModelBinding', 'ParallelWrapper', 'is_parallel_wrapper']
