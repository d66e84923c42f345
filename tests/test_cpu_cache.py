"""``mmfsdp.cpu_cache``: the caching CPU allocator that ``env_cfg.cpu_allocator='cache'`` installs.

The allocator replaces torch's CPU allocator for the whole process, so each
behaviour is observed in a fresh interpreter (the harness's one-rank run), never
in the test process. One interpreter observes every behaviour below, each
recorded on its own; the tests read one observation each.
"""
import os
import random
from typing import Any, Dict

import pytest
import torch

from harness import run_distributed
from mmfsdp.allocator import glibc

MiB = 1 << 20
MIN_BYTES = 64 << 10

pytestmark = pytest.mark.skipif(glibc() is None, reason='needs Linux with glibc')


def _rss() -> int:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmRSS:'))


def _counters() -> Dict[str, int]:
    from mmfsdp import cpu_cache
    return vars(cpu_cache.stats()).copy()


def _observe() -> Dict[str, Any]:
    """Install the allocator in this (fresh) process and record what each behaviour does."""
    from mmfsdp import cpu_cache
    seen: Dict[str, Any] = dict(installed=cpu_cache.install(MIN_BYTES, huge_pages=False).installed)
    seen['installed_again'] = cpu_cache.install(MIN_BYTES, huge_pages=False).installed
    other = cpu_cache.install(2 * MIN_BYTES, huge_pages=True)
    seen['installed_other'] = dict(installed=other.installed, reason=other.reason,
                                   min_bytes=cpu_cache.installed_min_bytes())

    # A freed block serves the next request of its size: same address, no new mapping.
    first = torch.ones(3 * MiB // 4)
    address = first.data_ptr()
    del first
    before = _counters()
    second = torch.zeros(3 * MiB // 4)
    after = _counters()
    seen['reuse'] = dict(same_address=second.data_ptr() == address,
                         hits=after['hits'] - before['hits'],
                         fresh_bytes=after['fresh_bytes'] - before['fresh_bytes'],
                         zeroed=bool((second == 0).all()))
    del second

    # Tensors below the threshold keep torch's allocator.
    before = _counters()
    small = torch.ones(MIN_BYTES // 8)
    seen['small_live_delta'] = _counters()['live_bytes'] - before['live_bytes']
    del small

    # Kernels that take scratch memory through raw_allocate (the vectorised GELU does).
    x = torch.randn(4, 256, 3072, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.gelu(x)
    y.sum().backward()
    reference = 0.5 * x.detach() * (1 + torch.erf(x.detach() / 2 ** 0.5))
    seen['gelu_max_diff'] = (y.detach() - reference).abs().max().item()
    seen['gelu_grad_finite'] = bool(x.grad.isfinite().all())
    del x, y, reference

    # Live + cached never exceeds the bound, nor the bound the most ever live, whatever the order.
    rng = random.Random(0)
    live, worst = [], 0
    for _ in range(400):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live)))
        else:
            live.append(torch.empty(rng.choice([64 << 10, 300 << 10, MiB, 3 * MiB, 7 * MiB]),
                                    dtype=torch.uint8))
        c = _counters()
        worst = max(worst, c['live_bytes'] + c['cached_bytes'] - c['bound'],
                    c['bound'] - c['high_water'])
    seen['bound_excess'] = worst
    del live

    # A forked child (a DataLoader worker) allocates through its copy of the cache.
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if large tensors still allocate and free
        try:
            ok = all(float(torch.full((2 * MiB // 4,), i).sum()) == i * (2 * MiB // 4)
                     for i in range(5))
        finally:
            os._exit(0 if ok else 1)
    seen['fork_child_status'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    # A one-off peak stays cached through its window and the next, then is unmapped.
    cpu_cache.release()
    spike, step = torch.ones(32 * MiB // 4), torch.ones(MiB // 4)
    del spike, step  # the spike's window: 33 MiB live at once, now all cached
    cached_spike = _counters()['cached_bytes']
    freed_first = cpu_cache.mark()  # the bound is still the spike's
    step = torch.ones(MiB // 4)  # the next window: 1 MiB at once, from the cache
    del step
    rss_before = _rss()
    freed_second = cpu_cache.mark()
    seen['window'] = dict(cached_spike=cached_spike, freed_first=freed_first,
                          freed_second=freed_second, bound=_counters()['bound'],
                          rss_returned=rss_before - _rss())

    # release() hands every cached block back to the system.
    block = torch.ones(16 * MiB // 4)
    del block
    rss_cached = _rss()
    seen['released'] = cpu_cache.release()
    seen['cached_after_release'] = _counters()['cached_bytes']
    seen['rss_returned'] = rss_cached - _rss()
    return seen


@pytest.fixture(scope='module')
def seen() -> Dict[str, Any]:
    return run_distributed(_observe, 1, timeout=120)[0]


def test_it_builds_and_installs_once_per_process(seen):
    assert seen['installed'] and seen['installed_again']


def test_a_second_install_with_other_settings_says_why_and_the_first_stays(seen):
    other = seen['installed_other']
    assert not other['installed'] and other['min_bytes'] == MIN_BYTES
    assert 'installed already' in other['reason'] and f'{MIN_BYTES} bytes' in other['reason']


def test_a_threshold_below_one_byte_is_refused_before_anything_is_built():
    from mmfsdp import cpu_cache
    with pytest.raises(ValueError, match='min_bytes must be at least 1'):
        cpu_cache.install(0, huge_pages=False)


def test_a_freed_block_serves_the_next_request_of_its_size(seen):
    reuse = seen['reuse']
    assert reuse['same_address'] and reuse['hits'] == 1 and reuse['fresh_bytes'] == 0, reuse
    assert reuse['zeroed'], 'torch.zeros on a reused block must still read zeros'


def test_tensors_below_the_threshold_keep_torchs_allocator(seen):
    assert seen['small_live_delta'] == 0


def test_kernels_with_raw_scratch_buffers_compute_correctly(seen):
    assert seen['gelu_max_diff'] < 1e-12 and seen['gelu_grad_finite']


def test_the_cache_never_holds_more_than_the_live_high_water_mark(seen):
    excess = seen['bound_excess']
    assert excess <= 0, f'live + cached exceeded the bound (or it the high-water) by {excess}'


def test_a_forked_child_allocates_through_its_copy(seen):
    assert seen['fork_child_status'] == 0


def test_a_one_off_peak_is_unmapped_two_windows_later(seen):
    window = seen['window']
    assert window['cached_spike'] >= 33 * MiB and window['freed_first'] == 0, window
    assert window['freed_second'] >= 32 * MiB and window['bound'] < 2 * MiB, window
    assert window['rss_returned'] >= 30 * MiB, window


def test_release_returns_the_cached_blocks_to_the_system(seen):
    assert seen['released'] >= 16 * MiB and seen['cached_after_release'] == 0
    assert seen['rss_returned'] >= 15 * MiB, seen['rss_returned']


def _without_compiler(cache_dir: str) -> Dict[str, Any]:
    os.environ.update(CXX=os.path.join(cache_dir, 'no-such-compiler'), XDG_CACHE_HOME=cache_dir)
    from mmfsdp import cpu_cache
    result = cpu_cache.install(MIN_BYTES, huge_pages=False)
    return dict(installed=result.installed, reason=result.reason, active=cpu_cache.installed())


def test_without_a_compiler_install_says_why_and_changes_nothing(tmp_path):
    result = run_distributed(_without_compiler, 1, str(tmp_path), timeout=120)[0]
    assert not result['installed'] and not result['active']
    assert 'could not be built' in result['reason'] and 'no-such-compiler' in result['reason']


def _rebuilt_after_a_broken_file(cache_dir: str) -> Dict[str, Any]:
    os.environ['XDG_CACHE_HOME'] = cache_dir
    from mmfsdp import cpu_cache
    path = cpu_cache._library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b'\x7fELF truncated')
    result = cpu_cache.install(MIN_BYTES, huge_pages=False)
    return dict(installed=result.installed, reason=result.reason,
                rebuilt=path.read_bytes()[:4] == b'\x7fELF' and path.stat().st_size > 1024)


def test_a_build_that_cannot_be_loaded_is_built_again(tmp_path):
    """A truncated file (or one linked against a c10 since replaced) is rebuilt, once."""
    seen = run_distributed(_rebuilt_after_a_broken_file, 1, str(tmp_path), timeout=180)[0]
    assert seen['installed'] and seen['rebuilt'], seen


def _compiler_past_its_time(cache_dir: str) -> Dict[str, Any]:
    import time
    pids = os.path.join(cache_dir, 'pids')
    compiler = os.path.join(cache_dir, 'slow-c++')
    with open(compiler, 'w') as f:  # a driver whose child (as cc1plus would) outlives it
        f.write(f'#!/bin/sh\nsleep 600 &\necho $! > {pids}\nwait\n')
    os.chmod(compiler, 0o755)
    os.environ.update(CXX=compiler, XDG_CACHE_HOME=cache_dir)
    from mmfsdp import cpu_cache
    cpu_cache.COMPILE_TIMEOUT_S = 1
    result = cpu_cache.install(MIN_BYTES, huge_pages=False)
    with open(pids) as f:
        child = int(f.read())
    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.01)
    return dict(installed=result.installed, reason=result.reason, child_running=_running(child),
                left=sorted(os.listdir(os.path.join(cache_dir, 'mmfsdp'))))


def _running(pid: int) -> bool:
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] not in ('Z', 'X')
    except FileNotFoundError:
        return False


def test_a_compiler_past_its_time_is_stopped_with_its_children(tmp_path):
    """The build runs in a session of its own: a timeout kills every process of it, so
    none writes into the cache afterwards, and install says why."""
    seen = run_distributed(_compiler_past_its_time, 1, str(tmp_path), timeout=120)[0]
    assert not seen['installed'] and 'ran past 1 s' in seen['reason'], seen
    assert not seen['child_running'] and seen['left'] == [], seen


def _profiled() -> Dict[str, Any]:
    from mmfsdp import cpu_cache
    cpu_cache.install(MIN_BYTES, huge_pages=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        block = torch.ones(4 * MiB // 4)
        del block
    usage = [e.cpu_memory_usage for e in prof.events()]
    return dict(allocated=max(usage), freed=-min(usage))


def test_torch_profiler_sees_the_tensors_it_serves():
    seen = run_distributed(_profiled, 1, timeout=120)[0]
    assert seen['allocated'] >= 4 * MiB and seen['freed'] >= 4 * MiB, seen
