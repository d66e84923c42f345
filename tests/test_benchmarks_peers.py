"""The peers benchmark's machinery (benchmarks/peers.py, peer_arms.py, peers_report.py).

One real torchrun job of 2 processes (the tiny GPT, 3 steps) runs both kinds of
case the benchmark runs: the memory case of mmfsdp FSDP1 alone, then the
interleaved case of hand-written torch FSDP1 and mmfsdp FSDP1; the report's
parsing then has to find the shard, the agreeing losses and one ratio per
timed round. The third-party arms (accelerate, Lightning) are not run here:
they are optional dependencies and their runs belong to ``python -m benchmarks.peers``.
"""
import io
import os
import subprocess
import sys

import pytest

from benchmarks import peers, peers_report
from benchmarks.launch import REPO, torchrun

ARMS = ['torch FSDP1', 'mmfsdp FSDP1']
STEPS, TIMED_FROM = 3, 1


@pytest.fixture(scope='module')
def tiny_run():
    cases = peers.plan_cases('gpt-tiny', ARMS, STEPS, TIMED_FROM, batch_size=2, seq_len=16,
                             memory_steps=2)
    memory = [c for c in cases['memory'] if c['arms'] == ['mmfsdp FSDP1']]
    results = torchrun(memory + [cases['interleaved']], nproc=2, timeout=240,
                       exact_allocator=True)
    return dict(mode='peers', nproc=2, results=results)


def test_orchestrator_knows_every_arm():
    """peers.py lists the arms without importing torch; the list must be peer_arms' own."""
    from benchmarks import peer_arms
    assert peers.ARM_LABELS == list(peer_arms.ARMS)
    for label, arm in peer_arms.ARMS.items():
        assert peers_report.family(label) == arm.family, label
    with pytest.raises(ValueError, match='--arms'):
        peers.plan_cases('gpt-tiny', ['torch FSDP3'], 2, 1, 2, 16, 2)


def test_tiny_run_shards_agrees_and_times_every_round(tiny_run):
    rows = {r['label']: r for r in peers_report.arm_rows(tiny_run)}
    mine = rows['mmfsdp FSDP1']
    assert mine['memory']['ok'] and mine['memory']['wrapper'] == 'MMFullyShardedDataParallel'
    assert mine['sharded'], 'parameter storage per rank must be about half the model at N = 2'
    assert mine['memory']['state']['max'] > 0 and mine['memory']['peak']['median'] > 0
    # malloc's live bytes between steps hold at least the model state (glibc on Linux)
    assert mine['memory']['live']['min'] >= mine['memory']['state']['max']
    # Same weights, same batches: the same losses on every rank, to float precision.
    assert mine['loss_delta'] <= 1e-5
    inter = tiny_run['results'][-1]['ranks']
    for rank in inter:
        ref, got = rank['losses']['torch FSDP1'], rank['losses']['mmfsdp FSDP1']
        assert len(ref) == STEPS and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5
    assert mine['ratio']['n'] == STEPS - TIMED_FROM
    lines = '\n'.join(peers_report.peers_lines(tiny_run, img_dir=None))
    assert '| mmfsdp FSDP1 | FSDP1 | yes |' in lines


def test_report_flags_arms_that_do_not_shard_or_fail():
    """An FSDP arm whose parameters stay whole, and an arm that raised, are named as such
    and left out of mmfsdp's goals."""
    state = dict(params=400, grads=400, optimizer=800, total=1600)
    half = dict(params=200, grads=200, optimizer=400, total=800)

    def memory(arm, states, ok=True):
        rank = (dict(ok=True, peaks=[3000, 3000], losses=[1.0, 1.0], states=states,
                     wrapper='W', notes='') if ok else
                dict(ok=False, stage='build', error='ValueError: only on GPU', where=['x.py:1 f']))
        return dict(mode='memory', arms=[arm], model='gpt-tiny', params=100, batch_size=2,
                    seq_len=16, steps=2, ranks=[rank, rank])

    data = dict(mode='peers', nproc=2, results=[
        memory('torch FSDP1', [half, half]), memory('mmfsdp FSDP1', [half, half]),
        memory('accelerate FSDP1', [state, state]),
        memory('Fabric FSDPStrategy', None, ok=False)])
    rows = {r['label']: r for r in peers_report.arm_rows(data)}
    assert rows['mmfsdp FSDP1']['sharded'] and not rows['accelerate FSDP1']['sharded']
    text = '\n'.join(peers_report.peers_lines(data, img_dir=None))
    assert 'does not shard' in text and '`ValueError: only on GPU`' in text
    compared = [m for g, _, m, _ in peers_report.goals(list(rows.values()))]
    assert compared and all('accelerate' not in m and 'Fabric' not in m for m in compared)


def test_a_run_builds_every_arm_once_before_any_twice():
    """Repeated memory jobs go round the arms, so a drift of the machine over the run
    reaches every arm alike."""
    cases = peers.plan_cases('gpt-tiny', ARMS, 2, 1, 2, 16, 2, memory_repeats=3)
    assert [(c['arms'][0], c['repeat']) for c in cases['memory']] == [
        (arm, repeat) for repeat in range(3) for arm in ARMS]
    assert len({c['name'] for c in cases['memory']}) == 6
    with pytest.raises(ValueError, match='--memory-repeats'):
        peers.plan_cases('gpt-tiny', ARMS, 2, 1, 2, 16, 2, memory_repeats=0)


def test_an_arm_that_failed_is_not_run_again(tmp_path):
    """mmengine's own FSDPStrategy cannot build on a CPU-only torch: one job says so, and
    its repeats would only say it again."""
    args = peers.parser().parse_args([
        '--model', 'gpt-tiny', '--seq-len', '16', '--memory-steps', '2', '--memory-repeats', '2',
        '--arms', 'mmengine FlexibleRunner FSDP', '--skip-interleaved',
        '--out', str(tmp_path / 'peers.json')])
    data = peers.run(args, log=io.StringIO())
    failed, = data['results']
    assert not peers.memory_ok(failed) and failed['repeat'] == 0


def test_report_pools_the_steps_of_every_memory_job_of_an_arm():
    """An arm's peak is the median over the measured steps of all its jobs (each job's
    first step, AdamW's state, left out), each job's own median is listed, and a job
    that failed fails the arm."""
    mib = 1 << 20
    half = dict(params=200, grads=200, optimizer=400, total=800)

    def memory(arm, repeat, peaks, ok=True):
        rank = (dict(ok=True, peaks=[p * mib for p in peaks], starts=[0] * len(peaks),
                     losses=[1.0] * len(peaks), states=[half] * len(peaks), wrapper='W',
                     notes='') if ok else
                dict(ok=False, stage='train', error='RuntimeError: gloo', where=[]))
        return dict(mode='memory', arms=[arm], repeat=repeat, model='gpt-tiny', params=100,
                    batch_size=2, seq_len=16, steps=len(peaks), ranks=[rank, rank])

    data = dict(mode='peers', nproc=2, results=[
        memory('torch FSDP1', 0, [999, 10, 12]), memory('mmfsdp FSDP1', 0, [999, 14, 14]),
        memory('torch FSDP1', 1, [999, 16, 16]), memory('mmfsdp FSDP1', 1, [999, 11, 12])])
    rows = {r['label']: r for r in peers_report.arm_rows(data)}
    assert rows['torch FSDP1']['memory']['peak'] == dict(median=14 * mib, min=10 * mib,
                                                         max=16 * mib, n=4)
    assert rows['mmfsdp FSDP1']['memory']['job_peaks'] == [14 * mib, 11.5 * mib]
    text = '\n'.join(peers_report.peers_lines(data, img_dir=None))
    assert '2 torchrun jobs per arm' in text
    assert "Each job's median step peak, MiB, in the order the jobs ran: mmfsdp FSDP1 14.0, " \
           '11.5; torch FSDP1 11.0, 16.0.' in text
    data['results'].append(memory('torch FSDP1', 2, [999, 1], ok=False))
    rows = {r['label']: r for r in peers_report.arm_rows(data)}
    assert not rows['torch FSDP1']['memory']['ok']
    assert rows['torch FSDP1']['memory']['error'] == 'RuntimeError: gloo'


def test_report_says_the_interleaved_job_failed_and_times_nothing():
    """An error in the interleaved job ends it (it may be one rank's alone); the report
    then gives no step times or losses, and quotes the job's last error line."""
    half = dict(params=200, grads=200, optimizer=400, total=800)
    rank = dict(ok=True, peaks=[3000, 3000], losses=[1.0, 1.0], states=[half, half],
                wrapper='W', notes='')
    data = dict(mode='peers', nproc=2, results=[
        dict(mode='memory', arms=['mmfsdp FSDP1'], model='gpt-tiny', params=100, batch_size=2,
             seq_len=16, steps=2, ranks=[rank, rank]),
        dict(mode='interleaved', arms=['mmfsdp FSDP1'], steps=3, timed_from=1,
             job_failed='Traceback ...\nFileNotFoundError: vis_data/config.py')])
    row, = peers_report.arm_rows(data)
    assert 'ratio' not in row and 'loss' not in row
    text = '\n'.join(peers_report.peers_lines(data, img_dir=None))
    assert 'The interleaved job failed' in text and 'FileNotFoundError: vis_data' in text


def test_report_splits_each_peak_at_the_start_of_its_step():
    """mmfsdp's peak against the lowest peer of its family: what was resident when the step
    began, and what the step added (the first step, AdamW's state, left out)."""
    mib = 1 << 20
    half = dict(params=200, grads=200, optimizer=400, total=800)

    def memory(arm, starts, peaks, lives):
        rank = dict(ok=True, peaks=[p * mib for p in peaks], starts=[s * mib for s in starts],
                    lives=[v * mib for v in lives], losses=[1.0, 1.0, 1.0], states=[half] * 3,
                    wrapper='W', notes='')
        return dict(mode='memory', arms=[arm], model='gpt-tiny', params=100, batch_size=2,
                    seq_len=16, steps=3, ranks=[rank, rank])

    data = dict(mode='peers', nproc=2, results=[
        memory('torch DDP', [0, 100, 102], [90, 130, 132], [0, 98, 98]),
        memory('mmfsdp DDP', [0, 104, 104], [95, 134, 136], [0, 98, 99])])
    text = '\n'.join(peers_report.peers_lines(data, img_dir=None))
    assert ("mmfsdp DDP 104.0 + 31.0 against torch DDP 101.0 + 30.0 (malloc's live bytes "
            'then: 98.5 against 98.0)') in text


def test_report_judges_tensor_peaks_on_the_median_step():
    """A tensor-peaks run adds its table and, per family, mmfsdp's median step peak (the
    worst rank's) against the lowest peer's, among the peers that run at its settings."""
    mib = 1 << 20
    half = dict(params=200, grads=200, optimizer=400, total=800)
    rank = dict(ok=True, peaks=[3000, 3000], losses=[1.0, 1.0], states=[half, half],
                wrapper='W', notes='')
    data = dict(mode='peers', nproc=2, results=[
        dict(mode='memory', arms=[arm], model='gpt-tiny', params=100, batch_size=2,
             seq_len=16, steps=2, ranks=[rank, rank]) for arm in ('torch FSDP1', 'mmfsdp FSDP1')])

    def counted(arm, peaks, python):  # one rank; the first step (AdamW's state) left out
        steps = [dict(start=0, peak=p * mib, end=0) for p in (999, *peaks)]
        return dict(arm=arm, ranks=[dict(steps=steps, python_held=python)])

    tensors = dict(date_utc='today', results=[
        counted('torch FSDP1', [235, 239, 235], {'torch': mib}),
        counted('mmfsdp FSDP1', [237, 235, 235], {'torch': mib, 'matplotlib': mib // 4})])
    text = '\n'.join(peers_report.peers_lines(data, img_dir=None, tensors=tensors))
    assert ('| mmfsdp FSDP1 | 0.00 | 235.00 (235.00–237.00) | 1.25 (torch 1.00, matplotlib '
            '0.25) |') in text
    assert ('| mmfsdp FSDP1: tensor peak per rank ≤ every FSDP1 peer counted | ≤ 1.00 × the '
            'lowest peer | 1.000 × torch FSDP1 (235.00 / 235.00 MiB) | **pass** |') in text
    tensors['results'][1] = counted('mmfsdp FSDP1', [236, 236, 235], {})
    text = '\n'.join(peers_report.peers_lines(data, img_dir=None, tensors=tensors))
    assert '1.004 × torch FSDP1 (236.00 / 235.00 MiB) | **fail** |' in text


def test_report_section_replaces_only_its_own_lines(tmp_path):
    doc = tmp_path / 'benchmarks.md'  # a generator's section between hand-kept lines
    doc.write_text('\n'.join(['## 10. Before', 'kept', peers_report.TITLE, 'old table',
                              '<!-- peak-truth:begin -->', '## 12. After', 'kept too']))
    peers_report.write_section(str(doc), peers_report.load(), img_dir=None)  # the committed run
    text = doc.read_text()
    assert 'old table' not in text and text.count(peers_report.TITLE) == 1
    assert text.index('kept') < text.index(peers_report.TITLE) < text.index(
        '<!-- peak-truth:begin -->') < text.index('## 12. After')


def test_every_runner_a_job_builds_gets_its_own_experiment_name():
    """mmengine reuses a logger / visualizer by name (name + the second it was built); a case
    built in the same second as the previous one must not write into its deleted directory."""
    from benchmarks.peer_arms import experiment_name
    assert experiment_name('mmfsdp FSDP1') != experiment_name('mmfsdp FSDP1')


@pytest.fixture(scope='module')
def tensor_peaks():
    """benchmarks/tensor_peaks.py on hand-written torch DDP and mmfsdp DDP (gpt-tiny, 2 ranks)."""
    case = dict(kind='tensor_peak', model='gpt-tiny', steps=3, batch_size=2, seq_len=16)
    return {arm: torchrun([dict(case, arm=arm)], nproc=2, timeout=240, exact_allocator=True)[0]
            for arm in ('torch DDP', 'mmfsdp DDP')}


def test_mmfsdp_ddp_holds_and_adds_the_same_tensor_bytes_as_torch_ddp(tensor_peaks):
    """Tensors of 4 KiB and more, counted from torch's profiler: within each step mmfsdp
    DDP's rise exactly as hand-written torch DDP's, and between steps it holds the same."""
    mine, theirs = tensor_peaks['mmfsdp DDP']['ranks'], tensor_peaks['torch DDP']['ranks']
    for rank, (m_rank, t_rank) in enumerate(zip(mine, theirs)):
        for step, (m, t) in enumerate(zip(m_rank['steps'], t_rank['steps'])):
            assert m['peak'] - m['start'] == t['peak'] - t['start'], (rank, step, m, t)
            assert m['start'] == t['start'], (rank, step, m, t)


def test_a_plain_loop_pays_for_seeding_as_the_runner_does(tensor_peaks):
    """Every arm seeds like the training script it stands for. Seeding keeps a formatted
    stack, which from a process's second seed reads a torch source file of 0.27 MiB into
    ``linecache``: the plain loop's standard-library objects match the runner's."""
    mine, theirs = tensor_peaks['mmfsdp DDP']['ranks'], tensor_peaks['torch DDP']['ranks']
    for m_rank, t_rank in zip(mine, theirs):
        stdlib = m_rank['python_held'].get('stdlib', 0), t_rank['python_held'].get('stdlib', 0)
        assert abs(stdlib[0] - stdlib[1]) <= 64 << 10, stdlib


def test_what_the_runner_holds_besides_tensors_is_counted_by_package(tensor_peaks):
    """The Python objects an arm keeps: mmengine's Runner keeps its visualizer's
    matplotlib figure and yapf's cache of the formatted config; a plain loop neither."""
    for rank in tensor_peaks['mmfsdp DDP']['ranks']:
        assert rank['python_held'].get('matplotlib', 0) > 0
        assert rank['python_held'].get('yapf', 0) > 0
    for rank in tensor_peaks['torch DDP']['ranks']:
        assert 'matplotlib' not in rank['python_held'] and 'yapf' not in rank['python_held']


def test_malloc_live_bytes_count_a_tensor_while_it_lives():
    """The live bytes that tell memory in use from placement: a tensor is in them from its
    allocation to its free (torch's CPU allocator takes it from glibc's malloc). In a
    fresh process, with glibc's malloc (no allocator preloaded)."""
    code = (
        'import torch\n'
        'from benchmarks.measure import malloc_live_bytes\n'
        'before = malloc_live_bytes()\n'
        'tensor = torch.empty(8 << 20, dtype=torch.uint8)\n'
        'during = malloc_live_bytes()\n'
        'del tensor\n'
        'print(before, during, malloc_live_bytes())\n')
    env = {k: v for k, v in os.environ.items() if k != 'LD_PRELOAD'}
    out = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True, env=env).stdout
    before, during, after = map(int, out.split())
    assert during - before >= 8 << 20 and during - after >= 8 << 20
