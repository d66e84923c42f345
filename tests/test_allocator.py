"""``env_cfg.cpu_allocator``: glibc's malloc set by the runner, on CPU, in documented launches.

The resolver is checked in-process; the effect in real jobs started with
``tools/dist_train.sh`` (2 CPU processes, gloo), whose config imports
``tests/allocator_check.py``: by default a freed 8 MiB tensor stays in mmfsdp's
caching allocator and serves the next one; with ``'release'`` (and by default
where no compiler can build the cache) it is mapped on its own and goes back
to the system; with ``'glibc'`` glibc's own rules keep it in the heap.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from harness import JOB_TIMEOUT_S, REPO, free_port, job_env, run_job
from mmfsdp.allocator import (
    DEFAULT,
    POLICIES,
    AllocatorPolicy,
    apply_policy,
    glibc,
    resolve_cpu_allocator,
)

TESTS = Path(__file__).resolve().parent
MiB = 1 << 20

needs_glibc = pytest.mark.skipif(glibc() is None, reason='needs Linux with glibc')


def test_default_is_the_cache_preset():
    assert resolve_cpu_allocator(None) is POLICIES[DEFAULT] is POLICIES['cache']
    assert POLICIES[DEFAULT].cache_min_bytes == 64 * 1024
    # What is left where the cache cannot be built: 'release'.
    assert POLICIES[DEFAULT].mmap_threshold == POLICIES['release'].mmap_threshold == 1 * MiB


def test_opt_out_changes_nothing():
    policy = resolve_cpu_allocator('glibc')
    assert not policy.changes_anything
    assert apply_policy(policy, 'cpu') is None


def test_custom_values_are_resolved():
    policy = resolve_cpu_allocator(dict(mmap_threshold=4 * MiB, trim_interval=10))
    assert policy == AllocatorPolicy('custom', mmap_threshold=4 * MiB, trim_interval=10)


@pytest.mark.parametrize('value, error, words', [
    ('fast', ValueError, ["env_cfg.cpu_allocator: 'fast'", "'cache'", "'glibc'", "'release'"]),
    (dict(cache_min_bytes=-1), ValueError, ['env_cfg.cpu_allocator.cache_min_bytes']),
    (dict(cache_min_bytes=0), ValueError, ['cache_min_bytes', 'at least 4096', 'a page']),
    (1, TypeError, ['env_cfg.cpu_allocator', 'a preset name']),
    (dict(mmap=1), TypeError, ["unknown keys ['mmap']", 'mmap_threshold']),
    (dict(trim_interval=-1), ValueError, ['env_cfg.cpu_allocator.trim_interval', '-1']),
    (dict(mmap_threshold=True), ValueError, ['env_cfg.cpu_allocator.mmap_threshold']),
])
def test_bad_values_name_the_key(value, error, words):
    with pytest.raises(error) as info:
        resolve_cpu_allocator(value)
    for word in words:
        assert word in str(info.value)


def _second_runner_asks_otherwise() -> dict:
    """One process, three runners' policies in turn: the default, 'glibc', a bigger threshold."""
    import logging

    from mmfsdp import allocator
    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: List[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    seen = {}
    for name, policy in (('default', POLICIES[DEFAULT]), ('glibc', POLICIES['glibc']),
                         ('1 MiB', resolve_cpu_allocator(dict(cache_min_bytes=MiB)))):
        allocator.apply_policy(policy, 'cpu')
        kept = Kept()
        logger = logging.getLogger(f'policy-{name}')
        logger.addHandler(kept)
        logger.setLevel(logging.INFO)
        allocator.log_active(logger)
        seen[name] = dict(cache_in_effect=allocator.cache_in_effect(),
                          log=[(r.levelname, r.getMessage()) for r in kept.records])
    return seen


@needs_glibc
def test_a_later_runner_is_told_the_cache_installed_earlier_stays():
    """torch's CPU allocator is set once per process: a later runner asking for no cache or
    for another threshold keeps the first one (and its window hook), with a warning why."""
    from harness import run_distributed
    seen = run_distributed(_second_runner_asks_otherwise, 1, timeout=120)[0]
    assert seen['default']['cache_in_effect'] and seen['default']['log'][0][0] == 'INFO'
    for name in ('glibc', '1 MiB'):
        assert seen[name]['cache_in_effect'], (name, seen[name])
        (level, message), = seen[name]['log']
        assert level == 'WARNING' and 'stays in force' in message and '65536 bytes' in message


def test_accelerators_are_left_alone():
    """On CUDA the caching allocator owns device memory: nothing is set."""
    assert apply_policy(POLICIES['release'], 'cuda') is None


def _dist_train(tmp_path: Path, name: str, *cfg_options: str,
                **env_vars: str) -> Tuple[List[dict], str]:
    """``bash tools/dist_train.sh`` on 2 processes, the check hook added; findings and log."""
    out_dir = tmp_path / name
    config = tmp_path / f'{name}.py'
    config.write_text('\n'.join([
        f"_base_ = [{str(REPO / 'configs' / 'gpt-nano_fsdp_2xcpu.py')!r}]",
        "custom_imports = dict(imports=['allocator_check'], allow_failed_imports=False)",
        f"custom_hooks = [dict(type='AllocatorCheckHook', out_dir={str(out_dir)!r})]",
        'train_cfg = dict(max_iters=1, val_interval=2)',
        'default_hooks = dict(checkpoint=dict(save_last=False))', '']))
    # The allocator settings of the test run must not reach the job.
    env = job_env(TESTS, unset=('MALLOC_*', 'GLIBC_TUNABLES', 'THP_MEM_ALLOC_ENABLE'),
                  PYTHON=sys.executable, PORT=str(free_port()), **env_vars)
    out = run_job(['bash', 'tools/dist_train.sh', str(config), '2', '--work-dir',
                   str(tmp_path / f'work-{name}'), *cfg_options], env=env)
    return [json.loads((out_dir / f'rank{r}.json').read_text()) for r in range(2)], out


@needs_glibc
def test_documented_launch_caches_freed_blocks_for_the_next_tensor(tmp_path):
    found, log = _dist_train(tmp_path, 'default')
    assert ("env_cfg.cpu_allocator: 'cache' (mmap_threshold=1048576, huge pages, caching "
            'allocator for tensors of 65536 bytes and more)') in log
    for rank, seen in enumerate(found):
        assert seen['policy']['name'] == DEFAULT and seen['policy']['cache_in_effect'], seen
        assert seen['cached'] >= 8 * MiB, f'rank {rank}: 8 MiB block not from the cache: {seen}'
        assert seen['reused'], f'rank {rank}: the freed block did not serve the next: {seen}'
        assert seen['window_hook'], f'rank {rank}: no CacheWindowHook ends the windows: {seen}'


@needs_glibc
def test_release_returns_freed_blocks_and_opt_out_keeps_glibc(tmp_path):
    release, log = _dist_train(tmp_path, 'release', '--cfg-options',
                               'env_cfg.cpu_allocator=release')
    opt_out, opt_out_log = _dist_train(tmp_path, 'glibc', '--cfg-options',
                                       'env_cfg.cpu_allocator=glibc')
    assert "env_cfg.cpu_allocator: 'release' (mmap_threshold=1048576, huge pages)" in log
    assert 'env_cfg.cpu_allocator' not in opt_out_log
    for rank, seen in enumerate(release):
        assert seen['policy'] is not None and seen['policy']['name'] == 'release', seen
        assert seen['mapped'] >= 8 * MiB, f'rank {rank}: 8 MiB block not mapped: {seen}'
        assert seen['returned'] >= 7 * MiB, f'rank {rank}: freed block stayed resident: {seen}'
    for rank, seen in enumerate(opt_out):
        assert seen['policy'] is None, seen
        assert seen['mapped'] == 0, f'rank {rank}: glibc mapped the block itself: {seen}'


@needs_glibc
def test_without_a_compiler_the_default_warns_and_returns_freed_blocks(tmp_path):
    found, log = _dist_train(tmp_path, 'nocompiler', CXX=str(tmp_path / 'no-such-compiler'),
                             XDG_CACHE_HOME=str(tmp_path / 'cache'))
    assert 'WARNING' in log and 'caching allocator NOT in effect' in log
    assert 'no-such-compiler' in log
    for rank, seen in enumerate(found):
        assert not seen['policy']['cache_in_effect'] and seen['cached'] == 0, seen
        assert not seen['window_hook'], seen
        assert seen['mapped'] >= 8 * MiB and seen['returned'] >= 7 * MiB, (rank, seen)


@needs_glibc
def test_torch_honours_thp_mem_alloc_enable_set_before_its_first_allocation():
    """The private torch behaviour behind ``huge_pages`` (``mmfsdp.compat.enable_cpu_huge_pages``).

    c10 reads ``THP_MEM_ALLOC_ENABLE`` at the first CPU allocation; set after
    ``import torch`` but before any tensor, it must take effect (page-aligned
    tensors of 2 MiB and more); set after a tensor exists, it must not.
    """
    code = ('import os, torch\n'
            'from mmfsdp.compat import enable_cpu_huge_pages\n'
            'late = os.environ.get("LATE") == "1"\n'
            'x = torch.empty(3 << 20, dtype=torch.uint8) if late else None\n'
            'print(enable_cpu_huge_pages())\n')
    env = {k: v for k, v in os.environ.items() if k != 'THP_MEM_ALLOC_ENABLE'}
    env['PYTHONPATH'] = os.pathsep.join([str(REPO), env.get('PYTHONPATH', '')])
    seen = {}
    for late in ('0', '1'):
        out = subprocess.run([sys.executable, '-c', code], env=dict(env, LATE=late),
                             capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        assert out.returncode == 0, out.stderr[-3000:]
        seen[late] = out.stdout.split()[-1]
    assert seen == {'0': 'True', '1': 'False'}, (
        'torch no longer reads THP_MEM_ALLOC_ENABLE at its first CPU allocation '
        f'(c10/core/alloc_cpu.cpp): {seen}; see mmfsdp.compat.enable_cpu_huge_pages')
