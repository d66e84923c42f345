"""Smoke test of the benchmark harness (benchmarks/): structure and exact counts, no timings.

Runs ``python -m benchmarks.run --smoke``: the tiny GPT at world sizes 1 and 2,
two steps, every kind of measurement, cases packed into one torchrun job per
world size; then checks the results file, the report and the plots. Only
quantities that are exact by construction are compared with theory (storage
bytes, collective sizes); nothing about speed is asserted.
"""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = ['DDP', 'FSDP1 FULL_SHARD', 'FSDP1 SHARD_GRAD_OP', 'FSDP1 NO_SHARD',
              'FSDP2 reshard', 'FSDP2 no-reshard']
SUMMARY = {'median', 'min', 'max', 'n'}


@pytest.fixture(scope='module')
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    subprocess.run([sys.executable, '-m', 'benchmarks.run', '--smoke', '--out',
                    str(out / 'results.json'), '--report', str(out / 'report.md'),
                    '--img-dir', str(out / 'img')], cwd=REPO, check=True, timeout=180,
                   capture_output=True, text=True)
    with open(out / 'results.json') as f:
        return out, json.load(f)


def _of(data, kind, **match):
    return [r for r in data['results'] if r['kind'] == kind
            and all(r.get(k) == v for k, v in match.items())]


def _summary(s, n=None):
    assert set(s) == SUMMARY
    assert s['min'] <= s['median'] <= s['max']
    if n is not None:
        assert s['n'] == n


def test_memory_results(smoke):
    _, data = smoke
    assert data['mode'] == 'smoke' and data['machine']['cores'] >= 1
    assert {(r['strategy'], r['world_size']) for r in _of(data, 'memory')} == \
        {('DDP', 1)} | {(s, 2) for s in STRATEGIES}
    for r in _of(data, 'memory'):
        for key in ('model_state_bytes', 'peak_bytes', 'comm_send_bytes', 'step_time_s'):
            _summary(r[key], r['steps'])
        assert r['steps'] == 2 and r['loss_finite'] and r['exact_allocator']
        assert len(r['model_state_parts']) == r['world_size']
        assert r['peak_bytes']['min'] > 0
        # Storage counting is exact: within padding of the ZeRO bound (SHARD_GRAD_OP and FSDP2
        # without resharding hold sharded parameters between steps, below their ZeRO-2 bound).
        state, bound = r['model_state_bytes']['max'], r['theory']['model_state_bytes']
        assert 0.75 * bound <= state <= 1.05 * bound, r['strategy']
        if r['world_size'] == 1:
            assert r['comm_send_bytes']['max'] == 0
        else:  # collective sizes are exact too: at most padding above theory
            ratio = r['comm_send_bytes']['max'] / r['theory']['comm_bytes']
            assert 0.85 <= ratio <= 1.05, r['strategy']
    ddp = _of(data, 'memory', strategy='DDP', world_size=2)[0]
    assert set(ddp['comm_by_op']) == {'allreduce'}  # DDP's buckets were counted
    plan = _of(data, 'memory', strategy='FSDP1 FULL_SHARD')[0]['plan']
    assert plan['available'] and plan['model_state_bytes'] > 0


def test_other_results(smoke):
    _, data = smoke
    overhead = {r['wrapper']: r for r in _of(data, 'overhead')}
    assert set(overhead) == {'fsdp1', 'fsdp2', 'ddp'}
    for wrapper, r in overhead.items():
        _summary(r['ratio'], r['steps'])
        _summary(r['extra_s'], r['steps'])
        assert set(r['step_time_s']) == {'mmfsdp', f'torch-{wrapper}'} | (
            {'torch-fsdp1'} if wrapper == 'fsdp2' else set())
    _summary(overhead['fsdp2']['fsdp2_over_fsdp1'], overhead['fsdp2']['steps'])
    construction = {r['init']: r for r in _of(data, 'construction')}
    assert set(construction) == {'eager', 'meta'}
    for r in construction.values():
        assert r['peak_bytes'] >= 0 and isinstance(r['warm_up_bytes'], int)
        assert r['goal_bytes'] == r['shard_bytes'] + 2 * r['largest_unit_bytes']
    checkpoint = {r['type']: r for r in _of(data, 'checkpoint')}
    assert set(checkpoint) == {'full', 'sharded'}
    for r in checkpoint.values():
        assert r['bytes'] > 12 * r['params']  # weights + two AdamW moments, fp32
        _summary(r['save_s'], 1)


def test_report(smoke):
    out, _ = smoke
    text = (out / 'report.md').read_text()
    for heading in ('## Goals', '## 1. Model-state', '## 2. Peak', '## 3. Communication',
                    '## 4. Wrapper overhead', '## 5. FSDP2 vs FSDP1', '## 6. Checkpoint',
                    '## 7. Construction', '## Method'):
        assert heading in text
    # Sections 8-11 are rendered from the committed benchmarks/results/*.json, in this order.
    numbered = [line for line in text.splitlines() if re.match(r'## \d+\. ', line)]
    assert [int(line[3:].split('.')[0]) for line in numbered] == list(range(1, 12))
    for heading in ('## 8. Gradient accumulation', '## 9. CPU allocator', '## 10. GPU',
                    '## 11. The peers side by side'):
        assert heading in text
    assert sorted(os.listdir(out / 'img')) == ['memory_gpt-tiny.png', 'overhead.png', 'peers.png']
    assert (out / 'img' / 'overhead.png').read_bytes()[:4] == b'\x89PNG'


def test_report_rewrite_keeps_the_peak_truth_section_before_the_observations(smoke, tmp_path):
    from benchmarks.report import KEPT, write_report
    out, data = smoke
    begin, end = KEPT[0]
    doc = tmp_path / 'report.md'
    block = f"{begin}\n## 12. The plan's step peak against the measured peak\n\nrows\n{end}"
    doc.write_text((out / 'report.md').read_text() + '\n' + block + '\n')
    for _ in range(2):  # a rewrite keeps it, once, numbered after the generated sections
        write_report(data, str(doc), str(tmp_path / 'img'))
        text = doc.read_text()
        assert text.count(begin) == 1 and block in text
        assert text.index('## 11. The peers') < text.index(block) < text.index('## Observations')


def _allocator_job(setting, strategy, peak_mib, step_s, rnd, n=2):
    return dict(world_size=n, setting=setting, strategy=strategy, round=rnd,
                peak_bytes=[peak_mib << 20] * 2, peak_rss_bytes=[peak_mib << 20] * 2,
                end_rss_bytes=[peak_mib << 20] * 2, step_time_s=[step_s] * 2,
                step_cpu_s=[step_s] * 2)


def test_allocator_report_nets_the_floor_and_times_each_arm_against_glibc_in_its_round():
    """Net peak = peak - the gpt-tiny floor of the same arm; FSDP / DDP per setting; the
    step-time ratio to glibc's is taken within a round, and judged against 1.15."""
    from benchmarks.allocator import DEFAULT, GLIBC, summarize
    jobs = [_allocator_job(s, st, 100, 1.0, 'floor') for s in (DEFAULT, GLIBC)
            for st in ('DDP', 'FSDP1 FULL_SHARD')]
    for rnd, slow in ((0, 1.0), (1, 2.0)):  # the machine twice as loaded in round 1
        jobs += [_allocator_job(GLIBC, 'DDP', 1100, 1.0 * slow, rnd),
                 _allocator_job(GLIBC, 'FSDP1 FULL_SHARD', 1000, 2.0 * slow, rnd),
                 _allocator_job(DEFAULT, 'DDP', 1100, 1.0 * slow, rnd),
                 _allocator_job(DEFAULT, 'FSDP1 FULL_SHARD', 600, 2.2 * slow, rnd)]
    rows = {r['setting']: r for r in summarize(dict(results=jobs))}
    assert rows[GLIBC]['net_peak_ratio'] == 900 / 1000
    assert rows[DEFAULT]['net_peak_ratio'] == 500 / 1000
    assert rows[DEFAULT]['FSDP1 FULL_SHARD']['time_ratios'] == pytest.approx([1.1, 1.1])
    from benchmarks.allocator import report
    text = report(dict(results=jobs))
    assert f'| 2 | {DEFAULT} | 0.500 (≤ 0.6: **pass**) |' in text
    assert '1.10 (1.10–1.10) **pass**' in text


def test_allocator_jobs_take_no_allocator_setting_from_the_caller(monkeypatch):
    """Every arm gets the launch's choice and its own variables, nothing of the caller's."""
    from benchmarks.allocator import SETTINGS, launch_env
    monkeypatch.setenv('LD_PRELOAD', '/usr/lib/libtcmalloc.so')
    monkeypatch.setenv('MALLOC_CONF', 'background_thread:true')
    monkeypatch.setenv('MALLOC_ARENA_MAX', '1')
    monkeypatch.setenv('MMFSDP_CPU_ALLOCATOR', 'glibc')
    env = launch_env(SETTINGS['launch default'])
    assert not {'LD_PRELOAD', 'MALLOC_CONF', 'MALLOC_ARENA_MAX', 'MMFSDP_CPU_ALLOCATOR'} & set(env)
    assert launch_env(SETTINGS['tcmalloc'])['MMFSDP_CPU_ALLOCATOR'] == 'tcmalloc'


@pytest.mark.parametrize('full_started, file_started, taken', [
    (None, None, True),                       # both undated (before runs were dated)
    ('2026-11-23 10:00 UTC', None, False),    # a dated full run is newer than an undated file
    ('2026-11-23 10:00 UTC', '2026-11-23 11:00 UTC', True),
    ('2026-11-23 12:00 UTC', '2026-11-23 11:00 UTC', False),
])
def test_report_takes_a_kind_measured_again_on_its_own_unless_the_full_run_is_newer(
        tmp_path, full_started, file_started, taken):
    from benchmarks.report import with_remeasured
    old = dict(kind='construction', name='old')
    other = dict(kind='memory', name='kept')
    full = dict(results=[old, other], **({'started': full_started} if full_started else {}))
    again = dict(results=[dict(kind='construction', name='new')], machine=dict(commit='abc'),
                 jobs=[dict(load_before=1.5), dict(load_before=2.5)],
                 **({'started': file_started} if file_started else {}))
    (tmp_path / 'construction.json').write_text(json.dumps(again))
    names = [r['name'] for r in with_remeasured(full, str(tmp_path))['results']]
    assert names == (['kept', 'new'] if taken else ['old', 'kept'])
    if taken:
        source = with_remeasured(full, str(tmp_path))['results'][-1]['remeasured']
        assert source == dict(file='construction.json', commit='abc', loads=(1.5, 2.5))


def test_peak_truth_section_adds_a_line_per_run_under_another_allocator(tmp_path):
    from benchmarks.peak_truth import BEGIN, END, write_section

    def result(name: str, measured: int, predicted: int) -> dict:
        return dict(name=name, model='gpt-25m', peak_bytes=dict(median=measured),
                    predicted=dict(peak_bytes=predicted))
    other = tmp_path / 'peak_truth_jemalloc.json'
    other.write_text(json.dumps([result('a/jemalloc', 100, 104), result('b/jemalloc', 100, 80)]))
    doc = tmp_path / 'doc.md'
    doc.write_text(f'head\n{BEGIN}\nthe previous section\n{END}\ntail\n')
    write_section([], str(doc), others=[str(other)])
    text = doc.read_text()
    assert ('Under jemalloc preloaded (`--cpu-allocator jemalloc`, '
            '`benchmarks/results/peak_truth_jemalloc.json`, gpt-25m): **1 of 2 cases within '
            "10 %**, errors -20.0% to +4.0%.") in text
    assert text.startswith('head\n') and text.endswith(f'{END}\ntail\n')
    assert 'the previous section' not in text
