"""The benchmarks' tables, blocks and probes, from made-up results (no processes)."""
import mmap
import os

import pytest

from benchmarks import accumulation, compile, load_bytes, memory, peers
from benchmarks.core import records
from benchmarks.core.workload import parameter_count

pytestmark = pytest.mark.bench
MIB = 2**20


def test_a_block_is_replaced_between_its_markers_and_nothing_else(tmp_path):
    doc = tmp_path / 'page.md'
    doc.write_text('# head\n\n<!-- begin: a -->\nold\n<!-- end: a -->\n\n'
                   '<!-- begin: b -->\nkept\n<!-- end: b -->\n')
    records.write_block(str(doc), 'a', 'new\n')
    assert doc.read_text() == ('# head\n\n<!-- begin: a -->\nnew\n<!-- end: a -->\n\n'
                               '<!-- begin: b -->\nkept\n<!-- end: b -->\n')
    with pytest.raises(ValueError, match='needs exactly one <!-- begin: c -->'):
        records.write_block(str(doc), 'c', 'text')


def test_every_block_a_script_writes_is_in_the_docs_page_once():
    with open(records.DOCS) as f:
        page = f.read()
    for name in ('model-state', 'peak', 'comm', 'fsdp2-vs-fsdp1', 'overhead',
                 'fsdp2-vs-fsdp1-time', 'checkpoint-cost', 'construction', 'accumulation',
                 'peers', 'peak-truth', 'compile', 'load-bytes', 'async-save', 'auto-wrap',
                 'fp32-norms'):
        assert page.count(f'<!-- begin: {name} -->') == 1, name
        assert page.count(f'<!-- end: {name} -->') == 1, name


def test_accumulation_theory_is_k_minus_1_extra_reduce_scatters():
    for n in (2, 4):
        for k in (1, 2, 4):
            extra = (accumulation.comm_factor('sharded', k, n)
                     - accumulation.comm_factor('unsharded', k, n))
            assert extra == pytest.approx((k - 1) * (n - 1) / n)
    cases = accumulation.plan_cases('gpt-100m', ['fsdp1', 'fsdp2'], [2, 4], [1, 2, 4], 2, 64, 0, 1)
    assert len(cases) == 2 * 2 * 5  # k = 1 once, k = 2 and 4 in both modes


def test_accumulation_compares_checkpointed_cases_with_their_own_k1():
    cases = accumulation.plan_cases('gpt-100m', ['fsdp1'], [2], [1, 4], 2, 64, 0, 1, ac=True)
    assert all(c['ac'] and '/ac/' in c['name'] for c in cases)

    def result(ac, k, mode, peak):
        peaks = dict(median=peak, min=peak, max=peak, n=1)
        return dict(wrapper='fsdp1', ac=ac, world_size=2, warmup=1, steps=1, counts=k,
                    mode=mode, params=1 << 20, peak_bytes=peaks,
                    comm_send_bytes=dict(median=1.0), theory_comm_bytes=1.0)

    rows = accumulation.table([result(False, 1, 'sharded', 100 << 20),
                               result(True, 1, 'sharded', 50 << 20),
                               result(True, 4, 'sharded', 52 << 20)]).splitlines()
    checkpointed = [r for r in rows if r.startswith('| fsdp1 + AC | 2 |')]
    assert len(checkpointed) == 2 and '| 1.040 |' in checkpointed[-1]


def _memory_result(strategy, n, peak, state, sent):
    stat = dict(median=peak, min=peak, max=peak, n=1)
    return dict(model='gpt-25m', strategy=strategy, world_size=n, params=25_416_704,
                peak_bytes=stat, model_state_bytes=dict(stat, median=state),
                model_state_parts=dict(params=state / 4, grads=state / 4, optimizer=state / 2),
                comm_send_bytes=dict(median=sent), comm_by_op={'allreduce': dict(calls=5)},
                step_time_s=dict(median=1.0, min=1.0, max=1.0, n=1),
                plan=dict(model_state_bytes=state, peak_estimate_bytes=state))


def test_memory_tables_divide_by_the_bounds_and_ddp():
    p = 25_416_704
    blocks = memory.tables([_memory_result('DDP', 2, 400 * MIB, 16 * p, 4 * p),
                            _memory_result('FSDP1 FULL_SHARD', 2, 240 * MIB, 8 * p, 6 * p),
                            _memory_result('FSDP2 reshard', 2, 250 * MIB, 8 * p, 6 * p)])
    assert '| gpt-25m (25.4M) | FSDP1 FULL_SHARD | 2 | 193.9 |' in blocks['model-state']
    assert '| 1.000 |' in blocks['model-state']
    assert '| 0.600 |' in blocks['peak']  # 240 / 400
    assert '(3(N-1)/N·P·b) | 1.0000 |' in blocks['comm']
    assert '| gpt-25m | 2 | 1.042 | 1.000 | 1.00 |' in blocks['fsdp2-vs-fsdp1']


def _peers_results(memory_arms, interleaved_arms, failing=()):
    def ranks(label, peak):
        ok = dict(ok=True, peaks=[999 * MIB, peak, peak], losses=[3.0] * 3,
                  wrapper=f'{label} wrapper', notes='',
                  states=[dict(params=48 * MIB, total=194 * MIB)] * 3)
        return [dict(ok=False, stage='build', error='RuntimeError: no device',
                     where=['x.py:1 f'])] * 2 if label in failing else [ok, ok]

    results = [dict(mode='memory', arms=[label], params=25_000_000, ranks=ranks(label, peak))
               for label, peak in memory_arms.items()]
    if interleaved_arms:
        times = {label: [1.0, 1.0, 1.0] for label in interleaved_arms}
        times[interleaved_arms[-1]] = [1.0, 1.1, 1.2]
        rank = dict(times=times, losses={label: [3.2] for label in interleaved_arms},
                    wrappers={label: 'W' for label in interleaved_arms},
                    notes={label: '' for label in interleaved_arms})
        results.append(dict(mode='interleaved', timed_from=1, params=25_000_000,
                            ranks=[rank, rank]))
    return results


def test_peers_table_without_memory_jobs_shows_the_interleaved_job():
    text = peers.report(_peers_results({}, ['torch DDP', 'mmfsdp DDP']))
    row = next(line for line in text.splitlines() if line.startswith('| mmfsdp DDP |'))
    assert '— (not measured)' in row and '1.150 (1.100–1.200)' in row
    assert '| mmfsdp DDP: step time / torch DDP, same rounds | ≤ 1.03 |' in text


def test_peers_report_flags_failures_and_judges_mmfsdp_against_the_lowest_peer():
    text = peers.report(_peers_results(
        {'torch FSDP1': 260 * MIB, 'mmfsdp FSDP1': 261 * MIB,
         'mmengine FlexibleRunner FSDP': 0}, [], failing=['mmengine FlexibleRunner FSDP']))
    assert '**no**: fails while building' in text
    assert '- **mmengine FlexibleRunner FSDP** (build): `RuntimeError: no device`' in text
    assert '| mmfsdp FSDP1: peak per rank ≤ every FSDP1 peer that runs' in text
    assert '1.004 × torch FSDP1 (261.0 / 260.0 MiB) | **fail** |' in text


def test_compile_tables_show_a_failed_job_as_a_row():
    ok = dict(model='vit', memory=False, step_s=dict(median=1.0, min=1.0, max=1.0, n=1),
              compile_s=10.0, graphs=1, load_before=1.0, load_after=2.0)
    text = compile.tables([dict(ok, arm='whole-step compile', compile_s=20.0),
                           dict(ok, arm='regional compile'),
                           dict(model='resnet50', arm='eager', memory=False, error='Boom | x',
                                load_before=1.0, load_after=1.0)])
    assert 'vit: regional / whole-step steady step 1.00 (holds ≤ 1), compile time 0.50' in text
    assert '| resnet50 | eager | failed: Boom / x |  |  | 1.0 → 1.0 |' in text


def _load_case(sharded_reads, full_reads, size=400):
    host = dict(size=size * MIB, cold_cached=0, host_cached=size * MIB)

    def rank(read, i):
        return dict(read=read * MIB, rchar=0, mapped=0, shard=100 * MIB, **(host if not i else {}))
    return dict(strategy='FSDP1 FULL_SHARD', ranks={
        'sharded': [rank(r, i) for i, r in enumerate(sharded_reads)],
        'full': [rank(r, i) for i, r in enumerate(full_reads)]})


def test_load_bytes_goals_and_table():
    held = load_bytes.verdicts([_load_case([101, 100, 100, 100], [300, 100, 0, 0])])
    assert list(held.values()) == [True, True]
    missed = load_bytes.verdicts([_load_case([101, 100, 120, 100], [400, 400, 400, 400])])
    assert list(missed.values()) == [False, False]
    text = load_bytes.table([_load_case([101, 100, 100, 100], [300, 100, 0, 0])])
    assert '| FSDP1 FULL_SHARD | sharded | 0 | 101.0 | 0.0 | 0.0 | 100.0 | 1.01 |' in text
    assert 'read / files 1.00 |' in text and text.splitlines()[1].startswith('|---|---|--:|')


def test_load_bytes_probes_see_a_dropped_file_come_back_through_a_mapping(tmp_path):
    path = tmp_path / 'data.bin'
    path.write_bytes(os.urandom(4 * MIB))
    load_bytes.drop_from_cache(str(tmp_path))
    if load_bytes.cached_bytes(str(tmp_path)):
        pytest.skip('this file system keeps the file in memory (tmpfs?)')
    before = load_bytes.io_counters()
    with open(path, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        touched = sum(mapped[i] for i in range(0, MIB, mmap.PAGESIZE))
        assert load_bytes.mapped_bytes(str(tmp_path)) >= MIB
    assert touched >= 0 and load_bytes.mapped_bytes(str(tmp_path)) == 0
    assert load_bytes.io_counters()['read_bytes'] - before['read_bytes'] >= MIB
    assert MIB <= load_bytes.cached_bytes(str(tmp_path)) <= 4 * MIB


def test_the_workload_presets_have_the_documented_sizes():
    assert parameter_count('gpt-25m') == 25_416_704
    assert parameter_count('gpt-100m') == 99_526_656
