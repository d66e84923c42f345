"""The private torch internal that needs a process group: gloo's worker threads, by name.

The others, one test per internal, are in ``tests/unit/test_compat.py``.
"""
import hashlib
import inspect
import re
import textwrap
from collections import deque

import pytest
import torch
import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1_module
from mmengine.config import Config
from mmengine.hooks import CheckpointHook
from mmengine.model import BaseModel, BaseModule
from mmengine.model.weight_init import PretrainedInit
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import MODEL_WRAPPERS
from mmengine.runner import Runner
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp import _init_utils as fsdp_init_utils
from torch.distributed.fsdp._flat_param import FlatParamHandle

from mmfsdp import compat


# ---- mmengine --------------------------------------------------------------


# ---- torch -----------------------------------------------------------------


def _gloo_workers_by_name():
    import datetime

    import torch.distributed as dist

    from harness import COLLECTIVE_TIMEOUT_S
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    dist.all_reduce(torch.ones(1))
    return len(compat.gloo_worker_threads())


def test_gloo_worker_threads_are_found_by_the_name_torch_gives_them():
    """``ProcessGroupGloo`` runs its collectives on threads named ``pt_gloo_runloop``."""
    from harness import run_distributed
    assert compat.GLOO_WORKER_THREAD == 'pt_gloo_runloop'
    assert all(n >= 1 for n in run_distributed(_gloo_workers_by_name, 2))


