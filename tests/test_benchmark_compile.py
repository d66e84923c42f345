"""benchmarks/compile.py: its report block; ``-m slow``: a ``--quick`` run. No timing asserted."""
import json
import subprocess
import sys

import pytest

from benchmarks import compile as bench

MIB = 2 ** 20


def _result(model, arm, step, compile_s=0.0, graphs=0, peak=None):
    r = dict(model=model, arm=arm, memory=peak is not None,
             step_s=dict(median=step, min=step, max=step, n=1), compile_s=compile_s,
             graphs=[graphs], load_before=[1.0, 1, 1],
             load_after=[2.0, 1, 1])
    if peak is not None:
        r['peak_bytes'] = dict(median=peak * MIB, min=peak * MIB, max=peak * MIB, n=1)
    return r


def _data():
    machine = dict(date='today', cpu='cpu', cores=2, python='3', torch='t', mmengine='m',
                   commit='c')
    return dict(machine=machine, command='python -m benchmarks.compile', results=[
        _result('vit', 'eager', 1.0),
        _result('vit', 'whole-step compile', 0.5, compile_s=100.0, graphs=13),
        _result('vit', 'regional compile', 0.6, compile_s=40.0, graphs=1),
        _result('vit', 'no checkpointing', 1.0, peak=300.0),
        _result('vit', 'full', 1.2, peak=120.0),
        dict(model='resnet50', arm='regional compile', memory=False, error='exit 1: Inductor|x',
             load_before=[3.0], load_after=[4.0])])


def test_the_block_shows_both_tables_and_the_goal_and_nothing_else_changes(tmp_path):
    text = bench.tables(_data())
    assert 'regional / whole-step steady step 1.20 (**misses** ≤ 1)' in text
    assert 'compile time 0.40 (holds ≤ 0.5)' in text
    assert '| vit | full | 120.0 (120.0–120.0) | 1.200 | 1.0 → 2.0 |' in text
    assert '| resnet50 | regional compile | failed: exit 1: Inductor/x |  |  | 3.0 → 4.0 |' in text
    doc = tmp_path / 'report.md'
    doc.write_text(f'# head\n\n{bench.BEGIN}\nold\n{bench.END}\n\n## after\n')
    bench.write_block(text, str(doc))
    bench.write_block(text, str(doc))  # a second refresh replaces the first
    assert doc.read_text() == f'# head\n\n{bench.BEGIN}\n{text}\n{bench.END}\n\n## after\n'
    doc.write_text('# no markers\n')
    with pytest.raises(ValueError, match='compile:begin'):
        bench.write_block(text, str(doc))


@pytest.mark.slow
def test_a_quick_run_measures_every_arm_of_the_vit(tmp_path):
    out = tmp_path / 'compile.json'
    subprocess.run([sys.executable, '-m', 'benchmarks.compile', '--quick', '--only', 'vit/',
                    '--out', str(out)], cwd=bench.REPO, check=True, timeout=1200,
                   capture_output=True, text=True)
    results = json.loads(out.read_text())['results']
    assert [(r['arm'], 'peak_bytes' in r) for r in results] == \
        [(a, False) for a in bench.TIME_ARMS] + [(a, True) for a in bench.MEMORY_ARMS]
    for r in results:
        assert r['step_s']['n'] == 2 and r['world_size'] == 2
        assert (r['graphs'][-1] > 0) == ('compile' in r['arm']), r['arm']
        assert r.get('peak_bytes', dict(min=1))['min'] > 0
