"""The documented launch commands (docs/launching.md), run for real on shortened schedules.

Each test starts the job the way a user does (``tools/dist_train.sh`` with
torchrun, ``tools/train.py`` on one process, ``tools/slurm_train.sh`` under
srun) and reads what a user reads: the log and the work directory. Slurm is
stood in for by a small ``srun`` that starts the tasks with the ``SLURM_*``
variables the real one sets, and an ``scontrol`` that names the host.

Every job runs in its own session under a deadline; a job past it is killed
with all its processes.
"""
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import List

import pytest

from harness import REPO, free_port, job_env, run_job

FSDP_CONFIG = 'configs/gpt-nano_fsdp_2xcpu.py'
DDP_CONFIG = 'configs/gpt-nano_ddp_2xcpu.py'
#: The Python-style twin (read_base, imported classes) runs under Slurm.
PY_FSDP_CONFIG = 'configs/py/gpt_nano_fsdp_2xcpu.py'
#: Byte-level model: guessing uniformly over 256 byte values has perplexity 256.
UNIFORM_PERPLEXITY = 256.0

TRAIN_LOSS = re.compile(r'Iter\(train\) \[\s*(\d+)/\d+\].*?\bloss: ([0-9.]+)')
PERPLEXITY = re.compile(r'Iter\((val|test)\) .*?lm/perplexity: ([0-9.]+)')


def _job(cmd: List[str], **variables: str) -> str:
    """Run ``cmd`` from the repository root, outside any Slurm or torchrun of the test run."""
    return run_job(cmd, env=job_env(REPO, unset=('SLURM_*',), **variables))


def train_losses(log: str) -> List[float]:
    return [float(loss) for _, loss in TRAIN_LOSS.findall(log)]


def perplexities(log: str, mode: str) -> List[float]:
    return [float(p) for m, p in PERPLEXITY.findall(log) if m == mode]


def test_readme_demo_trains_then_evaluates_its_checkpoint(tmp_path):
    """dist_train.sh on 2 CPU processes (FSDP), then test.py on the checkpoint (1 process)."""
    work_dir = tmp_path / 'train'
    log = _job(
        ['bash', 'tools/dist_train.sh', FSDP_CONFIG, '2', '--work-dir', str(work_dir),
         '--cfg-options', 'train_cfg.max_iters=10', 'train_cfg.val_interval=10',
         'default_hooks.logger.interval=2', 'train_dataloader.batch_size=8',
         'val_dataloader.dataset.num_samples=64'],
        PORT=str(free_port()), PYTHON=sys.executable)
    losses = train_losses(log)
    assert len(losses) == 5, log[-3000:]
    assert all(b < a for a, b in zip(losses, losses[1:])), f'loss did not fall: {losses}'
    (val_ppl,) = perplexities(log, 'val')
    assert val_ppl < UNIFORM_PERPLEXITY / 2
    checkpoint = work_dir / 'iter_10.pth'
    assert checkpoint.is_file()
    assert Path((work_dir / 'last_checkpoint').read_text().strip()) == checkpoint

    log = _job([sys.executable, 'tools/test.py', FSDP_CONFIG, str(checkpoint),
                '--launcher', 'none', '--work-dir', str(tmp_path / 'test'),
                '--cfg-options', 'test_dataloader.dataset.num_samples=64'])
    # The same 64 validation windows, evaluated by one process from the file.
    (test_ppl,) = perplexities(log, 'test')
    assert test_ppl == pytest.approx(val_ppl, rel=1e-3)


def test_ddp_config_trains_on_one_process(tmp_path):
    """`python tools/train.py CONFIG --launcher none`: no process group, no wrapper."""
    log = _job([sys.executable, 'tools/train.py', DDP_CONFIG, '--launcher', 'none',
                '--work-dir', str(tmp_path),
                '--cfg-options', 'train_cfg.max_iters=5', 'train_cfg.val_interval=100',
                'default_hooks.logger.interval=1', 'train_dataloader.batch_size=8'])
    losses = train_losses(log)
    assert len(losses) == 5 and losses[-1] < losses[0], losses
    assert 'Distributed training: False' in log
    assert (tmp_path / 'iter_5.pth').is_file()


FAKE_SRUN = """#!{python}
# Stands in for Slurm's srun: starts --ntasks copies of the command with the
# SLURM_* variables srun sets, records its options, exits with a failed task's code
# (with FAKE_SRUN_DRY_RUN set it only records).
import json, os, subprocess, sys

args, options = sys.argv[1:], {{}}
while args and args[0].startswith('-'):
    if args[0] in ('-p', '-J', '-n', '-N', '-c'):
        options[args[0]], args = args[1], args[2:]
    else:
        key, _, value = args[0].partition('=')
        options[key], args = value, args[1:]
ntasks = int(options['--ntasks'])
per_node = int(options.get('--ntasks-per-node', ntasks))
full, rest = divmod(ntasks, per_node)
first = [f'{{per_node}}(x{{full}})' if full > 1 else str(per_node)] if full else []
tasks_per_node = ','.join(first + ([str(rest)] if rest else []))
with open(os.environ['FAKE_SRUN_RECORD'], 'w') as f:
    json.dump(dict(options=options, command=args), f)
if os.environ.get('FAKE_SRUN_DRY_RUN'):
    sys.exit(0)
tasks = [subprocess.Popen(args, env=dict(
    os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks),
    SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node),
    SLURM_NNODES=str(-(-ntasks // per_node)), SLURM_NODELIST='node-[0-9]',
    SLURM_TASKS_PER_NODE=tasks_per_node,
    SLURM_JOB_NAME=options.get('--job-name', ''))) for rank in range(ntasks)]
codes = [task.wait() for task in tasks]
sys.exit(next((code for code in codes if code), 0))
"""
#: scontrol show hostnames NODELIST: the job's hosts, the first being the master.
FAKE_SCONTROL = '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo 127.0.0.1\n'


def _install_fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (('srun', FAKE_SRUN.format(python=sys.executable)),
                       ('scontrol', FAKE_SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_slurm_train_starts_ranks_from_srun_variables(tmp_path):
    """slurm_train.sh -> srun -> 2 x train.py --launcher slurm (rank, size, master from Slurm).

    The job trains the Python-style config, so it also runs end to end.
    """
    _install_fake_slurm(tmp_path / 'bin')
    record = tmp_path / 'srun.json'
    work_dir = tmp_path / 'work'
    env = dict(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
               FAKE_SRUN_RECORD=str(record), PYTHON=sys.executable, PORT=str(free_port()),
               GPUS='2', GPUS_PER_NODE='2', CPUS_PER_TASK='1', GRES='',
               SRUN_ARGS='--exclusive --time=5')
    log = _job(['bash', 'tools/slurm_train.sh', 'debug', 'gpt-nano', PY_FSDP_CONFIG,
                str(work_dir), '--cfg-options', 'train_cfg.max_iters=4',
                'train_cfg.val_interval=100', 'default_hooks.logger.interval=2',
                'train_dataloader.batch_size=4'], **env)
    srun = json.loads(record.read_text())
    assert srun['options'] == {'-p': 'debug', '--job-name': 'gpt-nano', '--ntasks': '2',
                               '--ntasks-per-node': '2', '--cpus-per-task': '1',
                               '--kill-on-bad-exit': '1', '--exclusive': '', '--time': '5'}
    assert srun['command'][:8] == [sys.executable, '-u', 'tools/train.py', PY_FSDP_CONFIG,
                                   f'--work-dir={work_dir}', '--launcher', 'slurm',
                                   '--cfg-options']
    assert 'Distributed launcher: slurm' in log and 'Distributed training: True' in log
    assert len(train_losses(log)) == 2
    assert (work_dir / 'iter_4.pth').is_file()

    # slurm_test.sh hands the same job to srun for test.py (recorded, not run:
    # test.py's slurm start-up is train.py's, checked above).
    env.update(FAKE_SRUN_DRY_RUN='1', GPUS='4', GPUS_PER_NODE='2', GRES='gpu:2', SRUN_ARGS='')
    _job(['bash', 'tools/slurm_test.sh', 'debug', 'gpt-nano-test', PY_FSDP_CONFIG,
          str(work_dir / 'iter_4.pth'), '--work-dir', str(tmp_path / 'test')], **env)
    srun = json.loads(record.read_text())
    assert srun['options'] == {'-p': 'debug', '--job-name': 'gpt-nano-test', '--gres': 'gpu:2',
                               '--ntasks': '4', '--ntasks-per-node': '2', '--cpus-per-task': '1',
                               '--kill-on-bad-exit': '1'}
    assert srun['command'] == [sys.executable, '-u', 'tools/test.py', PY_FSDP_CONFIG,
                               str(work_dir / 'iter_4.pth'), '--launcher', 'slurm',
                               '--work-dir', str(tmp_path / 'test')]
