"""benchmarks/load_bytes.py's probes and report block; a resume keeps none of its checkpoint.

One process, no timings: the page-cache and ``/proc`` probes on a file of this
test, the table and goals from made-up results, and a toy full checkpoint
resumed by ``FSDPRunner``, which must not keep what it loaded.
"""
import gc
import mmap
import os
import weakref

import pytest

from benchmarks import load_bytes as bench
from mmfsdp import FSDPRunner
from toy import FSDP1, checkpointing_config

MIB = 2**20


def test_probes_see_a_dropped_file_come_back_through_a_mapping(tmp_path):
    path = tmp_path / 'data.bin'
    path.write_bytes(os.urandom(4 * MIB))
    bench.drop_from_cache(str(tmp_path))
    if bench.cached_bytes(str(tmp_path)):
        pytest.skip('this file system keeps the file in memory (tmpfs?)')
    before = bench.io_counters()
    with open(path, 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        touched = sum(mapped[i] for i in range(0, MIB, mmap.PAGESIZE))
        assert bench.mapped_bytes(str(tmp_path)) >= MIB
    assert touched >= 0 and bench.mapped_bytes(str(tmp_path)) == 0
    assert bench.io_counters()['read_bytes'] - before['read_bytes'] >= MIB
    assert MIB <= bench.cached_bytes(str(tmp_path)) <= 4 * MIB
    assert bench.io_counters('thread-self')['rchar'] > 0


def _rank(read, shard=100, rchar=0, mapped=0):
    return dict(read=read * MIB, rchar=rchar * MIB, mapped=mapped * MIB, shard=shard * MIB)


def _case(sharded_reads, full_reads, size=400):
    host = dict(size=size * MIB, cold_cached=0, host_cached=size * MIB)
    results = {kind: [dict(_rank(r), **(host if i == 0 else {})) for i, r in enumerate(reads)]
               for kind, reads in (('sharded', sharded_reads), ('full', full_reads))}
    return dict(strategy='FSDP1 FULL_SHARD', results=results)


def test_goals_and_the_block_between_the_markers(tmp_path):
    held = bench.verdicts([_case([101, 100, 100, 100], [300, 100, 0, 0])])
    assert list(held.values()) == [True, True]
    missed = bench.verdicts([_case([101, 100, 120, 100], [400, 400, 400, 400])])
    assert list(missed.values()) == [False, False]
    text = bench.table([_case([101, 100, 100, 100], [300, 100, 0, 0])])
    assert '| FSDP1 FULL_SHARD | sharded | 0 | 101.0 | 0.0 | 0.0 | 100.0 | 1.01 |' in text
    assert 'read / files 1.00 |' in text
    doc = tmp_path / 'report.md'
    doc.write_text(f'# head\n\n{bench.BEGIN}\nold\n{bench.END}\n\n## after\n')
    bench.write_block(text, str(doc))
    assert doc.read_text() == f'# head\n\n{bench.BEGIN}\n{text}\n{bench.END}\n\n## after\n'


def test_a_resume_keeps_nothing_of_the_loaded_checkpoint(tmp_path):
    """The loaded tensors (mmap'd from the file) die with the resume; the weights live on."""
    def run(name, **extra):
        return FSDPRunner.from_cfg(checkpointing_config(
            str(tmp_path / name), FSDP1, 1, global_batch=4, max_iters=1, interval=1, **extra))

    run('saved').train()
    path = str(tmp_path / 'saved' / 'iter_1.pth')
    runner = run('resumed', resume_from=path)
    original, loaded, mapped = runner.load_checkpoint, [], []

    def load_checkpoint(*args, **kwargs):
        checkpoint = original(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in checkpoint['state_dict'].values())
        mapped.append(bench.mapped_bytes(path))
        return checkpoint

    runner.load_checkpoint = load_checkpoint
    runner.load_or_resume()
    gc.collect()
    assert loaded and mapped[0] > 0, 'the full file was not loaded through a mapping'
    kept = [ref() for ref in loaded if ref() is not None]
    assert not kept, f'the runner keeps {len(kept)} tensors of the loaded checkpoint'
