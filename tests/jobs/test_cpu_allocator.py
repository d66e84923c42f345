"""The CPU allocator is the launch's choice: the scripts' chooser, the runner's refusal of the
old config key, and what forked data workers pay for a preloaded allocator."""
import json
import os
import subprocess
import sys

import pytest

from harness import REPO, SUPPORT, free_port, job_env, run_job

CHOOSER = os.path.join(REPO, 'tools', 'cpu_allocator.sh')
#: Allocator variables of the test run that a job must not inherit.
ALLOCATOR_VARS = ('LD_PRELOAD', 'MMFSDP_CPU_ALLOCATOR', 'MALLOC_CONF', 'MALLOC_MMAP_THRESHOLD_')


def _choose(**variables):
    """Source the chooser in bash as the launch scripts do: (exit code, LD_PRELOAD, message)."""
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARS}
    env.update(variables)
    proc = subprocess.run(['bash', '-c', 'set -euo pipefail; source "$1"; '
                           'printf %s "${LD_PRELOAD:-}"', 'bash', CHOOSER],
                          env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr.strip()


def _installed(name):
    code, preload, _ = _choose(MMFSDP_CPU_ALLOCATOR=name)
    return code == 0 and name in preload


def test_the_launch_preloads_jemalloc_where_installed_and_says_so():
    if not _installed('jemalloc'):
        pytest.skip('jemalloc is not installed (Debian: apt-get install libjemalloc2)')
    code, preload, message = _choose()
    assert code == 0 and 'libjemalloc' in preload and os.path.isfile(preload)
    assert message == (f'mmfsdp: CPU allocator: preloading {preload} '
                       '(MMFSDP_CPU_ALLOCATOR=glibc to opt out)')


def test_the_launch_opts_out_keeps_a_users_preload_and_refuses_an_unknown_name():
    code, preload, message = _choose(MMFSDP_CPU_ALLOCATOR='glibc')
    assert (code, preload) == (0, '') and 'glibc' in message and 'nothing preloaded' in message
    mine = '/opt/lib/libtcmalloc_minimal.so.4'
    code, preload, message = _choose(LD_PRELOAD=mine)
    assert (code, preload) == (0, mine) and 'LD_PRELOAD already names it' in message
    code, _, message = _choose(MMFSDP_CPU_ALLOCATOR='cache')
    assert code == 2 and "MMFSDP_CPU_ALLOCATOR='cache' is not one of" in message


def test_env_cfg_cpu_allocator_is_refused_at_start_up_naming_the_key(tmp_path):
    """One process, no process group: the refusal comes first in setup_env."""
    from mmengine.config import Config

    from mmfsdp import FSDPRunner
    cfg = Config.fromfile(os.path.join(REPO, 'configs', 'gpt-nano_fsdp_2xcpu.py'))
    cfg.work_dir, cfg.launcher = str(tmp_path), 'none'
    cfg.env_cfg = dict(cfg.env_cfg, cpu_allocator='cache')
    with pytest.raises(ValueError, match=r"env_cfg\.cpu_allocator='cache'.*LD_PRELOAD"):
        FSDPRunner.from_cfg(cfg)


#: Iterations each worker-memory job trains; the probe reads at the last.
ITERS = 40


def _worker_memory(tmp_path, allocator):
    """One rank (``tools/dist_train.sh CONFIG 1``) with 2 persistent data workers, launched
    with ``MMFSDP_CPU_ALLOCATOR=allocator``; the probe's reading at iteration ``ITERS``."""
    out = tmp_path / f'{allocator}.json'
    config = tmp_path / f'workers_{allocator}.py'
    config.write_text('\n'.join([
        f"_base_ = [{os.path.join(REPO, 'configs', 'gpt-nano_fsdp_2xcpu.py')!r}]",
        'train_dataloader = dict(batch_size=8, num_workers=2, persistent_workers=True, '
        'dataset=dict(max_chars=200_000))',
        f'train_cfg = dict(by_epoch=False, max_iters={ITERS}, val_interval={ITERS + 1})',
        'val_dataloader = None', 'val_cfg = None', 'val_evaluator = None',
        "default_hooks = dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1000))",
        "custom_imports = dict(imports=['data_worker_probe'], allow_failed_imports=False)",
        f"custom_hooks = [dict(type='DataWorkerMemoryHook', out_file={str(out)!r}, "
        f'at_iter={ITERS})]', '']))
    env = job_env(REPO, SUPPORT, unset=ALLOCATOR_VARS,
                  MMFSDP_CPU_ALLOCATOR=allocator, PORT=str(free_port()), PYTHON=sys.executable)
    run_job(['bash', 'tools/dist_train.sh', str(config), '1', '--work-dir',
             str(tmp_path / allocator)], env=env)
    return json.loads(out.read_text())


def test_forked_data_workers_pay_nothing_for_the_preloaded_allocator(tmp_path):
    """The preloaded malloc is process-wide, so forked workers run on it too: their own
    (private) memory stays within 10 % (at least 4 MiB) of what they hold under glibc's."""
    if not _installed('jemalloc'):
        pytest.skip('jemalloc is not installed (Debian: apt-get install libjemalloc2)')
    jemalloc, glibc = _worker_memory(tmp_path, 'jemalloc'), _worker_memory(tmp_path, 'glibc')
    for run, malloc in ((jemalloc, 'jemalloc'), (glibc, 'glibc')):
        assert len(run['workers']) == 2, run
        assert {p['malloc'] for p in [run['parent'], *run['workers']]} == {malloc}, run
    mine, theirs = (sum(w['private'] for w in run['workers']) for run in (jemalloc, glibc))

    def total(run, key):
        return sum(p[key] for p in [run['parent'], *run['workers']]) / 2**20

    print(f"workers' private MiB: jemalloc {mine / 2**20:.1f}, glibc {theirs / 2**20:.1f}; "
          f"parent + workers, RSS MiB: jemalloc {total(jemalloc, 'rss'):.1f}, glibc "
          f"{total(glibc, 'rss'):.1f}; PSS MiB: jemalloc {total(jemalloc, 'pss'):.1f}, glibc "
          f"{total(glibc, 'pss'):.1f}")
    # a worker's own pages move by about a MiB from run to run; a cache that a worker
    # inherits and never drains costs it hundreds (1,182 vs 435 MiB in all, measured)
    assert mine <= theirs + max(0.10 * theirs, 4 << 20), (jemalloc, glibc)


def test_on_the_cpu_the_runner_registers_the_stock_runners_hooks(tmp_path):
    """No hook of mmfsdp's own for the allocator: the hooks of an FSDPRunner
    training on the CPU are the stock Runner's, in the same order and priorities (its
    CheckpointHook is mmfsdp's subclass of the stock one)."""
    from mmengine.config import Config
    from mmengine.hooks import CheckpointHook
    from mmengine.runner import Runner

    from mmfsdp import FSDPRunner
    hooks = []
    for runner_cls in (Runner, FSDPRunner):
        cfg = Config.fromfile(os.path.join(REPO, 'configs', 'gpt-nano_ddp_2xcpu.py'))
        cfg.work_dir, cfg.launcher = str(tmp_path / runner_cls.__name__), 'none'
        cfg.pop('runner_type', None)
        cfg.pop('model_wrapper_cfg', None)  # one process: no wrapper either way
        runner = runner_cls.from_cfg(cfg)
        assert runner.model.parameters().__next__().device.type == 'cpu'
        hooks.append([(h, h.priority) for h in runner.hooks])
    stock, mine = hooks
    assert [p for _, p in mine] == [p for _, p in stock]
    for (m, _), (s, _) in zip(mine, stock):
        assert isinstance(m, type(s)) and (type(m) is type(s) or isinstance(s, CheckpointHook))
