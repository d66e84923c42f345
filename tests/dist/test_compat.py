"""One test per private mmengine / torch internal that :mod:`mmfsdp.compat` relies on.

Each fails with a message naming the internal when a new mmengine or torch
release renames it, changes its signature or stops doing what mmfsdp relies
on; the fix is in ``mmfsdp/compat/`` (and wherever that message points).
Single process, no process group: these read the installed libraries.
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


class _Model(BaseModel):

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, inputs=None, data_samples=None, mode='tensor'):
        return self.fc(inputs)


@pytest.fixture(scope='module')
def runner(tmp_path_factory):
    """A stock Runner, one process, asked to load and resume (nothing is read)."""
    return Runner(model=_Model(), work_dir=str(tmp_path_factory.mktemp('compat')),
                  load_from='missing.pth', resume=True, experiment_name='compat_test')


# ---- mmengine --------------------------------------------------------------


def test_runner_keeps_load_from_and_resume_privately(runner):
    assert compat.load_from(runner) == 'missing.pth', 'Runner no longer keeps _load_from'
    assert compat.resume_requested(runner) is True, 'Runner no longer keeps _resume'


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


