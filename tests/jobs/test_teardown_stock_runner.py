"""mmfsdp's DDP wrapper under mmengine's *stock* Runner: finished 2-rank jobs exit cleanly.

A finished job must not abort at exit (SIGABRT, "terminate called without an
active exception", see :mod:`mmfsdp.dist`). ``FSDPRunner`` registers the
teardown itself; under the stock ``Runner`` only the wrapper can, by calling
:func:`mmfsdp.dist.teardown_at_exit` when it is built. The abort is a race
(2 of 3 runs in the report, none in 20 runs measured here on a quiet machine),
so each job also records what its ranks will run at exit, which is certain.

The jobs start the way a third-party train script does on a CPU-only host: it
starts the gloo group, then builds the stock ``Runner`` (whose ``init_dist``
calls ``torch.cuda.set_device``, which fails without CUDA).
"""
import json
import sys
from pathlib import Path

from harness import REPO, free_port, job_env, run_job

#: The user's train script: the group first (CPU-only host), then mmengine's stock Runner.
TRAIN_PY = """
import sys
import torch.distributed as dist
from mmengine.config import Config
from mmengine.runner import Runner
import mmfsdp  # noqa: F401

dist.init_process_group('gloo')
cfg = Config.fromfile(sys.argv[1])
cfg.launcher = 'pytorch'
cfg.work_dir = sys.argv[2]
Runner.from_cfg(cfg).train()
"""
#: A hook that writes what each rank will run at exit; the wrapper of the control job.
PROBE_PY = """
import json
import os
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, MODEL_WRAPPERS
from mmfsdp import MMDistributedDataParallel
from mmfsdp.dist import registered_at_exit, teardown_at_exit


@HOOKS.register_module()
class ExitTeardownProbe(Hook):
    def after_run(self, runner):
        with open(os.path.join(runner.work_dir, f'at_exit.{runner.rank}.json'), 'w') as f:
            json.dump(registered_at_exit(), f)


@MODEL_WRAPPERS.register_module()
class TeardownCallingDDP(MMDistributedDataParallel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        teardown_at_exit()
"""
#: The stock Runner (no runner_type): 6 iterations, one checkpoint at the end.
CONFIG = """
_base_ = ['{base}/models/gpt_nano.py', '{base}/datasets/stdlib_chars.py',
          '{base}/schedules/iter_based.py', '{base}/default_runtime.py']
model = dict(n_layer=2)
model_wrapper_cfg = dict(type='{wrapper}')
train_cfg = dict(by_epoch=False, max_iters=6, val_interval=100)
train_dataloader = dict(batch_size=8, dataset=dict(max_chars=200000))
default_hooks = dict(logger=dict(type='LoggerHook', interval=2))
env_cfg = dict(dist_cfg=dict(backend='gloo', timeout=120))
custom_imports = dict(imports=['exit_probe'], allow_failed_imports=False)
custom_hooks = [dict(type='ExitTeardownProbe')]
"""
RUNS = 3


def _jobs(tmp_path: Path, wrapper: str) -> list:
    """Run the stock-Runner job ``RUNS`` times (each must exit 0); what each rank registered."""
    (tmp_path / 'train.py').write_text(TRAIN_PY)
    (tmp_path / 'exit_probe.py').write_text(PROBE_PY)
    base = REPO / 'configs' / '_base_'
    (tmp_path / 'cfg.py').write_text(CONFIG.format(base=base, wrapper=wrapper))
    registered = []
    for run in range(RUNS):
        work_dir = tmp_path / f'run{run}'
        run_job([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2',
                 '--master-port', str(free_port()), 'train.py', 'cfg.py', str(work_dir)],
                env=job_env(REPO, tmp_path), cwd=tmp_path)
        assert (work_dir / 'iter_6.pth').exists()
        registered.append([json.loads((work_dir / f'at_exit.{r}.json').read_text())
                           for r in range(2)])
    return registered


def test_stock_runner_job_with_mmfsdp_ddp_exits_cleanly_every_time(tmp_path):
    registered = _jobs(tmp_path, 'mmfsdp.MMDistributedDataParallel')
    assert registered == [[['settle_gloo_workers']] * 2] * RUNS


def test_a_wrapper_calling_teardown_at_exit_covers_the_stock_runner(tmp_path):
    """The control: the same jobs, the wrapper calling the function when built."""
    registered = _jobs(tmp_path, 'TeardownCallingDDP')
    assert registered == [[['settle_gloo_workers']] * 2] * RUNS
