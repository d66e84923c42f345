"""The peers section of ``docs/benchmarks.md``, from ``benchmarks/results/peers.json``.

:mod:`benchmarks.peers` writes that file (one memory job per arm, one
interleaved job); :func:`benchmarks.report.render` adds this section when the
file exists. ``notes`` in the file are observations recorded by hand beside a
run (e.g. from a probe run), printed as they are. Where
``benchmarks/results/tensor_peaks.json`` exists (:mod:`benchmarks.tensor_peaks`),
its exact tensor counts of the same arms add a table and a goal per family.
"""
import json
import os
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from .tensor_peaks import describe_held, most_held

__all__ = ['RESULTS', 'arm_rows', 'goals', 'load', 'peers_lines']

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'peers.json')
#: :mod:`benchmarks.tensor_peaks`' results: the same arms' tensor bytes, counted exactly.
TENSOR_RESULTS = os.path.join(os.path.dirname(RESULTS), 'tensor_peaks.json')
MIB = 2**20
#: The hand-written torch arm of each family (the ratios' denominator).
REFERENCE = {'fsdp1': 'torch FSDP1', 'fsdp2': 'torch FSDP2', 'ddp': 'torch DDP'}
#: mmfsdp's arm of each family.
MMFSDP = {'fsdp1': 'mmfsdp FSDP1', 'fsdp2': 'mmfsdp FSDP2', 'ddp': 'mmfsdp DDP'}
#: Two arms "agree" when their losses after the last step differ by at most this.
LOSS_TOLERANCE = 1e-4
#: A parameter storage per rank below this share of the full model counts as sharded.
SHARDED_BELOW = 0.75
RATIO_GOAL = 1.03
TITLE = '## 11. The peers side by side'


def load(path: str = RESULTS) -> Optional[Dict[str, Any]]:
    """The recorded peers (or tensor peaks) run (``None`` when the file is absent)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def family(label: str) -> str:
    """The family of an arm label: which hand-written torch arm it is timed against."""
    if 'DDP' in label:
        return 'ddp'
    if 'FSDP2' in label or 'ModelParallel' in label:
        return 'fsdp2'
    return 'fsdp1'


def _summary(values: List[float]) -> Dict[str, float]:
    return dict(median=statistics.median(values), min=min(values), max=max(values),
                n=len(values))


def _memory(jobs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What an arm's memory jobs measured: ok/error, state, peak, parameter bytes.

    Each job's steps after its first (AdamW allocates its state there) are pooled: a
    figure per step is the worst rank's, and the summaries run over the pooled steps.
    One failed job makes the arm fail, with that job's error.
    """
    for result in jobs:
        if 'job_failed' in result:
            return dict(ok=False, error=result['job_failed'].strip().splitlines()[-1],
                        stage='job', where=[])
        failed = [r for r in result['ranks'] if not r['ok']]
        if failed:
            return dict(ok=False, error=failed[0]['error'], stage=failed[0]['stage'],
                        where=failed[0].get('where', []))

    def per_step(ranks: List[Dict[str, Any]], value: Callable[[Dict[str, Any], int], float]
                 ) -> List[float]:
        return [max(value(r, i) for r in ranks) for i in range(1, len(ranks[0]['peaks']))]

    peak, state, job_peaks, start, rise, live = [], [], [], [], [], []
    for result in jobs:
        ranks = result['ranks']
        job_peak = per_step(ranks, lambda r, i: r['peaks'][i])
        job_peaks.append(statistics.median(job_peak))
        peak += job_peak
        state += per_step(ranks, lambda r, i: r['states'][i]['total'])
        if all('starts' in r for r in ranks):  # the resident set when each step began
            start += per_step(ranks, lambda r, i: r['starts'][i])
            rise += per_step(ranks, lambda r, i: r['peaks'][i] - r['starts'][i])
        if all(r.get('lives') and None not in r['lives'] for r in ranks):  # malloc's, then
            live += per_step(ranks, lambda r, i: r['lives'][i])
    last = jobs[-1]['ranks']
    split = dict(start=_summary(start), rise=_summary(rise)) if len(rise) == len(peak) else {}
    if len(live) == len(peak):
        split['live'] = _summary(live)
    return dict(ok=True, peak=_summary(peak), state=_summary(state), job_peaks=job_peaks,
                params=max(r['states'][-1]['params'] for r in last), **split,
                parts=last[0]['states'][-1], wrapper=last[0]['wrapper'],
                notes=last[0].get('notes', ''))


def _interleaved(data: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    found = [r for r in data['results'] if r.get('mode') == 'interleaved']
    if not found or 'job_failed' in found[0]:
        return None
    return found[0]


def arm_rows(data: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One record per arm: memory job, ratio to its torch arm, loss after the last step."""
    jobs: Dict[str, List[Dict[str, Any]]] = {}
    for r in data['results']:
        if r.get('mode') == 'memory':
            jobs.setdefault(r['arms'][0], []).append(r)
    memory = {label: _memory(results) for label, results in jobs.items()}
    inter = _interleaved(data)
    times: Dict[str, List[float]] = {}
    losses: Dict[str, List[float]] = {}
    timed_from = 0
    if inter:
        rank0 = inter['ranks'][0]
        times, timed_from = rank0['times'], inter['timed_from']
        losses = {label: [r['losses'][label][-1] for r in inter['ranks']
                          if len(r['losses'].get(label, [])) == inter['steps']]
                  for label in rank0['losses']}
    labels = list(memory) or list(times)
    full = 4 * data['results'][0].get('params', 0)
    # Every arm against hand-written DDP (or the first arm, when DDP did not run).
    ref_loss = losses.get('torch DDP') or next(iter(losses.values()), None)
    rows = []
    for label in labels:
        fam = family(label)
        mem = memory.get(label, dict(ok=label in times))
        row: Dict[str, Any] = dict(label=label, family=fam, memory=mem)
        ref = REFERENCE[fam]
        if label in times and ref in times and len(times[label]) == len(times[ref]):
            ratios = [a / b for a, b in zip(times[label][timed_from:], times[ref][timed_from:])]
            row['ratio'] = _summary(ratios) if ratios else None
            row['step_s'] = _summary(times[label][timed_from:]) if ratios else None
        if label in losses and losses[label]:
            row['loss'] = losses[label]
            if ref_loss:
                row['loss_delta'] = max(abs(a - b) for a, b in zip(losses[label], ref_loss))
        if mem.get('ok') and 'params' in mem and full:
            row['sharded'] = mem['params'] < SHARDED_BELOW * full
        rows.append(row)
    return rows


def goals(rows: List[Dict[str, Any]]) -> List[Tuple[str, str, str, Optional[bool]]]:
    """(goal, target, measured, verdict) per mmfsdp arm and quantity."""
    by_label = {r['label']: r for r in rows}
    out: List[Tuple[str, str, str, Optional[bool]]] = []
    for fam, mine in MMFSDP.items():
        me = by_label.get(mine)
        if not me or not me['memory'].get('ok'):
            continue
        peers = _comparable_peers(rows, fam, mine)
        for key, name in (('state', 'model state'), ('peak', 'peak')):
            mine_v = me['memory'][key]['max' if key == 'state' else 'median']
            worst = max(peers, key=lambda r: mine_v / _value(r, key), default=None)
            if worst is None:
                continue
            ratio = mine_v / _value(worst, key)
            out.append((f'{mine}: {name} per rank ≤ every {fam.upper()} peer that runs',
                        '≤ 1.00 × the lowest peer',
                        f"{ratio:.3f} × {worst['label']} ({mine_v / MIB:,.1f} / "
                        f"{_value(worst, key) / MIB:,.1f} MiB)", ratio <= 1.0))
        if me.get('ratio'):
            med = me['ratio']['median']
            out.append((f'{mine}: step time / {REFERENCE[fam]}, same rounds', '≤ 1.03',
                        f"{med:.3f} ({me['ratio']['min']:.3f}–{me['ratio']['max']:.3f}) "
                        f"over {me['ratio']['n']} rounds", med <= RATIO_GOAL))
    return out


def tensor_rows(tensors: Optional[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per arm of a tensor-peaks run, over its steps after the first (which allocates
    AdamW's state): the most tensor bytes held between steps; the peak within a step,
    the worst rank's, as the median over the steps with the lowest and the highest (the
    same statistic as the resident-set peak); and the Python objects held after the
    last step by package (the rank holding most).

    Steps differ where collectives finish on gloo's threads in another order (FSDP on
    CPU): a step then peaks 2 or 4 MiB higher, in the hand-written torch arms too.
    """
    out = {}
    for r in (tensors or {}).get('results', []):
        steps = list(zip(*(rank['steps'] for rank in r['ranks'])))[1:]
        peaks = [max(s['peak'] for s in step) for step in steps]
        out[r['arm']] = dict(held=max(s['start'] for step in steps for s in step),
                             peak=_summary(peaks), python=most_held(r['ranks']))
    return out


def tensor_goals(rows: List[Dict[str, Any]], tensors: Dict[str, Dict[str, Any]]
                 ) -> List[Tuple[str, str, str, Optional[bool]]]:
    """(goal, target, measured, verdict): each mmfsdp arm's median tensor peak against
    the lowest of its family's peers that run at its settings (as for the resident-set
    goals) and were counted."""
    out: List[Tuple[str, str, str, Optional[bool]]] = []
    for fam, mine in MMFSDP.items():
        peers = [r['label'] for r in _comparable_peers(rows, fam, mine) if r['label'] in tensors]
        if mine not in tensors or not peers:
            continue
        low = min(peers, key=lambda label: tensors[label]['peak']['median'])
        mine_v, low_v = tensors[mine]['peak']['median'], tensors[low]['peak']['median']
        out.append((f'{mine}: tensor peak per rank ≤ every {fam.upper()} peer counted',
                    '≤ 1.00 × the lowest peer', f'{mine_v / low_v:.3f} × {low} '
                    f'({mine_v / MIB:,.2f} / {low_v / MIB:,.2f} MiB)', mine_v <= low_v))
    return out


def _tensor_lines(tensors: Optional[Dict[str, Any]], rows: List[Dict[str, Any]]) -> List[str]:
    """The tensor-peaks table: what of each arm's peak is tensors, what Python objects."""
    counted = tensor_rows(tensors)
    if not counted:
        return []
    lines = [f"Tensors apart from the rest: `python -m benchmarks.tensor_peaks`, run "
             f"{tensors.get('date_utc', '')} (`benchmarks/results/tensor_peaks.json`; same model, "
             'batches and initial weights, the same warm-up before the counts start), counts '
             'every tensor of 4 KiB and more ('
             + ("torch's profiler: each allocation and free of torch's CPU allocator"
                if tensors.get('counter') == 'torch.profiler' else
                "through mmfsdp's caching CPU allocator, since removed; the script now reads "
                "torch's profiler") + '): the bytes '
             'live between steps and the most live at once within a step, above those before the '
             'arm was built (worst rank, steps after the first), and, with `tracemalloc`, the '
             'Python objects the arm holds after its last step, by the package whose code '
             'allocated them (worst rank).', '',
             '| arm | tensors held between steps, MiB | tensor peak MiB per rank, median '
             '(min–max) | Python objects held, MiB (largest packages) |', '|---|---|---|---|']
    order = [r['label'] for r in rows if r['label'] in counted]
    for label in order + [a for a in counted if a not in order]:
        c = counted[label]
        peak = {k: c['peak'][k] / MIB for k in ('median', 'min', 'max')}
        lines.append(f"| {label} | {c['held'] / MIB:,.2f} "
                     f"| {peak['median']:,.2f} ({peak['min']:,.2f}–{peak['max']:,.2f}) "
                     f"| {describe_held(c['python'])} |")
    return lines + ['']


def _jobs_per_arm(data: Dict[str, Any]) -> str:
    repeats = 1 + max((r.get('repeat', 0) for r in data['results'] if r.get('mode') == 'memory'),
                      default=0)
    return ('one torchrun job per arm' if repeats == 1 else
            f'{repeats} torchrun jobs per arm (every arm once, then every arm again, ...)')


def _against_lowest_peer(rows: List[Dict[str, Any]]
                         ) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """Each mmfsdp arm that ran, with the lowest-peak peer of its family at its settings."""
    by_label = {r['label']: r for r in rows}
    pairs = []
    for fam, mine in MMFSDP.items():
        me = by_label.get(mine)
        peers = _comparable_peers(rows, fam, mine)
        if me and me['memory'].get('ok') and peers:
            pairs.append((me, min(peers, key=lambda r: _value(r, 'peak'))))
    return pairs


def _peak_split(rows: List[Dict[str, Any]]) -> List[str]:
    """Each mmfsdp peak against its family's lowest peer, split at the step's start."""
    parts = []
    for me, low in _against_lowest_peer(rows):
        if 'start' not in me['memory'] or 'start' not in low['memory']:
            continue
        live = ''
        if 'live' in me['memory'] and 'live' in low['memory']:
            live = (f" (malloc's live bytes then: {_mib(me['memory']['live']['median'])} "
                    f"against {_mib(low['memory']['live']['median'])})")
        parts.append(
            f"{me['label']} {_mib(me['memory']['start']['median'])} + "
            f"{_mib(me['memory']['rise']['median'])} against {low['label']} "
            f"{_mib(low['memory']['start']['median'])} + {_mib(low['memory']['rise']['median'])}"
            + live)
    if not parts:
        return []
    return ['Where the peak comes from: the resident set when the step began (above the '
            'baseline) + what the step added to it, MiB, medians over the measured steps, and '
            "the bytes glibc's malloc held live when the step began (above the baseline; "
            'tensors, C++ objects, large Python objects; equal live bytes with a larger '
            'resident set is placement, not memory in use): ' + '; '.join(parts) + '.', '']


def _job_spread(rows: List[Dict[str, Any]]) -> List[str]:
    """Where an arm ran more than one memory job: each job's median step peak, for
    mmfsdp's arms and their families' lowest peers (how far one job alone can move)."""
    parts = [f"{row['label']} " + ', '.join(_mib(p) for p in row['memory']['job_peaks'])
             for me, low in _against_lowest_peer(rows) if len(me['memory']['job_peaks']) > 1
             for row in (me, low)]
    if not parts:
        return []
    return ["Each job's median step peak, MiB, in the order the jobs ran: " + '; '.join(parts)
            + '.', '']


def _comparable_peers(rows: List[Dict[str, Any]], fam: str, mine: str
                      ) -> List[Dict[str, Any]]:
    """The arms of family ``fam`` other than mmfsdp's ``mine`` that run at its settings."""
    return [r for r in rows if r['family'] == fam and r['label'] != mine and _equal(r)]


def _equal(row: Dict[str, Any]) -> bool:
    """Whether an arm runs at mmfsdp's settings: it trains, shards if its family does, and
    its loss agrees (an arm that does not shard or does not synchronise is another setting)."""
    delta = row.get('loss_delta')
    return (bool(row['memory'].get('ok')) and (row['family'] == 'ddp' or bool(row.get('sharded')))
            and (delta is None or delta <= LOSS_TOLERANCE))


def _value(row: Dict[str, Any], key: str) -> float:
    return row['memory'][key]['max' if key == 'state' else 'median']


def _stage(mem: Dict[str, Any]) -> str:
    stage = mem.get('stage', '?')
    # The memory job builds the arm first on the tiny GPT (its warm-up step).
    return 'fails while building' if stage.startswith('warm-up') or stage == 'build' else stage


def _mib(n: float) -> str:
    return f'{n / MIB:,.1f}'


def _cells(row: Dict[str, Any], full: int) -> List[str]:
    mem = row['memory']
    if not mem.get('ok'):
        return [row['label'], row['family'].upper(), f"**no**: {_stage(mem)} (see below)"] + \
            ['—'] * 6
    shard = ('yes' if row.get('sharded') else
             ('no (replicated, as configured)' if row['family'] == 'ddp' else
              '**no: does not shard**'))
    ratio = row.get('ratio')
    loss = row.get('loss')
    delta = row.get('loss_delta')
    agree = ('' if delta is None else
             (f' (Δ {delta:.1e})' if delta <= LOSS_TOLERANCE else f' (**Δ {delta:.1e}**)'))
    return [row['label'], row['family'].upper(), 'yes',
            f"{mem['wrapper']}" + (f"; {mem['notes']}" if mem.get('notes') else ''),
            f"{_mib(mem['params'])} of {_mib(full)} — {shard}",
            _mib(mem['state']['max']), f"{_mib(mem['peak']['median'])} "
            f"({_mib(mem['peak']['min'])}–{_mib(mem['peak']['max'])})",
            '1 (reference)' if row['label'] == REFERENCE[row['family']] else
            (f"{ratio['median']:.3f} ({ratio['min']:.3f}–{ratio['max']:.3f})" if ratio else '—'),
            (f'{loss[0]:.6f}' + agree) if loss else '—']


def _plot(rows: List[Dict[str, Any]], img_dir: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [r['label'] for r in rows][::-1]
    by = {r['label']: r for r in rows}
    y = list(range(len(labels)))
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 0.45 * len(labels) + 1.6),
                                          sharey=True)
    for offset, key, name, color in ((0.2, 'state', 'model state', '#4c72b0'),
                                     (-0.2, 'peak', 'peak (median)', '#dd8452')):
        values = [(_value(by[a], key) / MIB if by[a]['memory'].get('ok') else 0) for a in labels]
        ax_mem.barh([i + offset for i in y], values, height=0.38, label=name, color=color)
    for i, a in enumerate(labels):
        if not by[a]['memory'].get('ok'):
            ax_mem.text(1, i, 'fails on CPU', va='center', fontsize=8, color='#a00')
        elif not by[a].get('sharded') and by[a]['family'] != 'ddp':
            ax_mem.text(_value(by[a], 'peak') / MIB + 5, i - 0.2, 'does not shard',
                        va='center', fontsize=8, color='#a00')
    ax_mem.set_yticks(y, labels, fontsize=8)
    ax_mem.set_xlabel('MiB per rank')
    ax_mem.legend(fontsize=8, loc='lower right')
    ax_mem.set_title('memory per rank', fontsize=10)
    for i, a in enumerate(labels):
        ratio = by[a].get('ratio')
        if ratio:
            ax_time.errorbar(ratio['median'], i, xerr=[[ratio['median'] - ratio['min']],
                                                       [ratio['max'] - ratio['median']]],
                             fmt='o', color='#55a868' if 'mmfsdp' in a else '#555', capsize=3)
    ax_time.axvline(1.0, color='#999', lw=0.8)
    ax_time.axvline(RATIO_GOAL, color='#c44', lw=0.8, ls='--', label='1.03')
    ax_time.set_xlabel('step time / hand-written torch arm of the family, same round')
    ax_time.set_title('step-time ratio: median, min–max over rounds', fontsize=10)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(img_dir, exist_ok=True)
    name = 'peers.png'
    fig.savefig(os.path.join(img_dir, name), dpi=110)
    plt.close(fig)
    return name


def peers_lines(data: Optional[Dict[str, Any]], img_dir: Optional[str],
                img_rel: str = 'img', tensors: Optional[Dict[str, Any]] = None) -> List[str]:
    """The section as Markdown lines (nothing without a recorded run); ``tensors``, a
    :mod:`benchmarks.tensor_peaks` run, adds its table and the tensor-peak goals."""
    if not data or not data.get('results'):
        return []
    rows = arm_rows(data)
    first = data['results'][0]
    full = 4 * first.get('params', 0)
    inter = _interleaved(data)
    loads = [x for r in data['results'] for x in (r.get('load_before'), r.get('load_after'))
             if x is not None]
    lines = [
        TITLE, '', '`python -m benchmarks.peers_report` writes this section from '
        '`benchmarks/results/peers.json`.', '',
        f"Measured by `python -m benchmarks.peers` (or `python -m benchmarks.run --peers`; "
        f"dependencies: `pip install -e .[benchmarks]`), run {data.get('started', '')}: "
        f"{first['model']} ({first.get('params', 0) / 1e6:.1f}M parameters, fp32, AdamW), "
        f"N = {data['nproc']} CPU processes (gloo), batch {first['batch_size']} × "
        f"{first['seq_len']} tokens per rank, the same per-rank batches and the same initial "
        'weights (one file, loaded through each framework\'s `init_weights` path or before '
        'wrapping) for every arm; one FSDP unit per `TransformerBlock` wherever the framework '
        'shards.', '',
        f'- **Memory**: {_jobs_per_arm(data)}, each alone in its processes, run exactly as section '
        '2: a warm-up step of the tiny GPT under the same arm, then the baseline, then '
        f"{first.get('steps', 0)} steps of which the first (AdamW allocates its state) is left "
        'out (the peak columns are over the measured steps of all of an arm\'s jobs); '
        'model state = storages of parameters, gradients and AdamW state right after '
        '`optimizer.step()`; peak = resident-set high-water mark of the step above the baseline '
        '(`MALLOC_MMAP_THRESHOLD_` as in Method). "Parameters per rank" is the storage behind '
        'the local parameters: an arm whose configuration asks for sharding but whose '
        'parameters stay at the full model size does not shard, whatever its config says.',
        '- **Step time and loss**: one torchrun job holding every arm that ran, '
        + (f"{inter['steps']} rounds of one step of each arm on the round's batch, the order "
           "rotated every round, each step timed between two barriers; the ratio of a round is "
           "the arm's step time over the hand-written torch arm of its family (FSDP1, FSDP2 or "
           f"DDP) in the same round, the first {inter['timed_from']} rounds left out. Loss = the "
           f"loss of step {inter['steps']} on each rank; Δ = the largest difference from "
           f"hand-written torch DDP over the ranks (agree: Δ ≤ {LOSS_TOLERANCE:g})."
           if inter else 'not recorded.'),
        f"- **Machine load**: the 1-minute load average was {min(loads):.1f}–{max(loads):.1f} "
        f"across the jobs ({data.get('machine', {}).get('cores', '?')} cores"
        + (f"; {data['machine_use']}" if data.get('machine_use') else '')
        + "); single rounds swing, so only the ratios of the same round are meaningful, and "
        "their medians." if loads else '', '']
    header = ['arm', 'family', 'runs on CPU', 'wrapper found (framework notes)',
              'parameters per rank MiB — shards?', 'model state MiB per rank',
              'peak MiB per rank, median (min–max)', 'step time / torch arm, median (min–max)',
              'loss after the last step (rank 0)']
    lines += ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(_cells(r, full)) + ' |' for r in rows]
    lines.append('')
    failed = [r for r in rows if not r['memory'].get('ok')]
    if failed:
        lines += ['Arms that do not run on CPU, with the exact error (every rank raised it):', '']
        for r in failed:
            where = r['memory'].get('where') or []
            lines.append(f"- **{r['label']}** ({_stage(r['memory'])}): "
                         f"`{r['memory'].get('error')}`"
                         + (f" — raised at `{where[-1]}`" if where else ''))
        lines.append('')
    failed_job = next((r for r in data['results'] if r.get('mode') == 'interleaved'
                       and 'job_failed' in r), None)
    if failed_job:
        lines += [f"The interleaved job failed, so no step times or losses: "
                  f"`{failed_job['job_failed'].strip().splitlines()[-1]}`", '']
    verdicts = goals(rows) + tensor_goals(rows, tensor_rows(tensors))
    if verdicts:
        lines += ['Goals: mmfsdp against every arm of its family that runs at the same '
                  'settings (it trains, shards where the family shards, and its loss agrees), '
                  'the hand-written torch arm included:', '',
                  '| goal | target | measured | result |', '|---|---|---|---|']
        lines += [f"| {g} | {t} | {m} | {'**pass**' if ok else '**fail**'} |"
                  for g, t, m, ok in verdicts]
        lines.append('')
    lines += _peak_split(rows)
    lines += _job_spread(rows)
    lines += _tensor_lines(tensors, rows)
    if img_dir:
        name = _plot(rows, img_dir)
        if name:
            lines += [f'![peers side by side]({img_rel}/{name})', '']
    lines += [f'- {note}' for note in data.get('notes', [])]
    return lines + ['']



def write_section(doc: str, data: Dict[str, Any], img_dir: str, img_rel: str = 'img',
                  tensors: Optional[Dict[str, Any]] = None) -> None:
    """Put the section into the Markdown file ``doc``, leaving the rest of it as it is.

    It replaces the section of the same title, up to the next heading or HTML
    comment (another generator's marker), or goes before "## Observations"
    (where :func:`benchmarks.report.render` puts it), or at the end.
    """
    with open(doc, encoding='utf-8') as f:
        lines = f.read().split('\n')
    section = peers_lines(data, img_dir, img_rel, tensors)
    if TITLE in lines:
        start = lines.index(TITLE)
        end = next((i for i in range(start + 1, len(lines))
                    if lines[i].startswith(('## ', '<!-- '))), len(lines))  # next section / marker
    else:
        start = end = lines.index('## Observations') if '## Observations' in lines else len(lines)
    lines[start:end] = section
    with open(doc, 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines))


def main() -> None:
    """``python -m benchmarks.peers_report [RESULTS] [--doc docs/benchmarks.md]``."""
    import argparse
    parser = argparse.ArgumentParser(description='Write the peers section into the report.')
    parser.add_argument('results', nargs='?', default=RESULTS)
    parser.add_argument('--doc', default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), 'docs', 'benchmarks.md'))
    args = parser.parse_args()
    data = load(args.results)
    if data is None:
        raise SystemExit(f'{args.results}: no such file (run python -m benchmarks.peers)')
    write_section(args.doc, data, os.path.join(os.path.dirname(args.doc), 'img'),
                  tensors=load(TENSOR_RESULTS))
    print(f'{args.doc}: {TITLE[3:]} written', file=sys.stderr)


if __name__ == '__main__':
    main()
