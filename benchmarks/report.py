"""The report: ``docs/benchmarks.md`` and its plots, from a results file of :mod:`benchmarks.run`.

``python -m benchmarks.report benchmarks/results/full.json [--out docs/benchmarks.md]``
rewrites the report without measuring again.
"""
import argparse
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .goals import MIB, OVERHEAD_LIMIT, Results, goals
from .goals import mib as _mib
from .goals import spread as _s
from .workload import MODELS, STRATEGIES

__all__ = ['goals', 'render', 'write_report']


def _mark(ok: Optional[bool]) -> str:
    return {True: '**pass**', False: '**FAIL**', None: 'not measured'}[ok]


def _params(n: int) -> str:
    return f'{n / 1e6:.1f}M'


# ---------------------------------------------------------------------------- tables

def _table(header: List[str], rows: Iterable[List[str]]) -> List[str]:
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
    return lines


def _memory_rows(res: Results, cell: Callable[[Dict[str, Any]], List[str]]
                 ) -> Iterable[List[str]]:
    for model in res.models():
        for label in STRATEGIES:
            for n in res.world_sizes():
                r = res.one('memory', model=model, strategy=label, world_size=n)
                if r:
                    yield [f'{model} ({_params(r["params"])})', label, str(n)] + cell(r)


def _state_cells(r: Dict[str, Any]) -> List[str]:
    state, bound = r['model_state_bytes']['max'], r['theory']['model_state_bytes']
    plan = r['plan']
    parts = max(r['model_state_parts'], key=lambda p: p['total'])
    return [_mib(state), f'{_mib(parts["params"])} / {_mib(parts["grads"])} / '
            f'{_mib(parts["optimizer"])}',
            f'{_mib(bound)} ({r["theory"]["model_state_formula"]})', f'{state / bound:.3f}',
            f'{_mib(plan["model_state_bytes"])}' if plan.get('available') else 'no plan']


def _peak_cells(res: Results) -> Callable[[Dict[str, Any]], List[str]]:
    def cells(r: Dict[str, Any]) -> List[str]:
        ddp = res.one('memory', model=r['model'], strategy='DDP', world_size=r['world_size'])
        plan = r['plan']
        return [_s(r['peak_bytes'], 1 / MIB, '{:,.1f}'), _mib(r['model_state_bytes']['max']),
                f'{r["peak_bytes"]["median"] / ddp["peak_bytes"]["median"]:.3f}' if ddp else '—',
                _mib(plan['peak_estimate_bytes']) if plan.get('available') else 'no plan',
                _s(r['step_time_s'])]
    return cells


def _comm_cells(r: Dict[str, Any]) -> List[str]:
    theory = r['theory']['comm_bytes']
    measured = r['comm_send_bytes']['max']
    ops = ', '.join(f'{op} ×{v["calls"]}' for op, v in r['comm_by_op'].items()) or 'none'
    return [_mib(measured), f'{_mib(theory)} ({r["theory"]["comm_formula"]})',
            f'{measured / theory:.4f}' if theory else '—', ops]


# ---------------------------------------------------------------------------- plots

def _plot_memory(res: Results, img_dir: str) -> List[str]:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    names = []
    for model in res.models():
        fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True, sharey=True)
        for ax, label in zip(axes.flat, STRATEGIES):
            rows = sorted((r for r in res.of('memory', model=model, strategy=label)),
                          key=lambda r: r['world_size'])
            if not rows:
                ax.set_visible(False)
                continue
            ns = [r['world_size'] for r in rows]
            params = rows[0]['params']
            grid = sorted(set(ns) | set(res.world_sizes()))
            theory = [STRATEGIES[label].state_bytes_per_param(n) * params / MIB for n in grid]
            ax.plot(grid, theory, 'k--', label=f'bound {STRATEGIES[label].state_bound}')
            if STRATEGIES[label].state_bound != '16P/N':
                ax.plot(grid, [16 * params / n / MIB for n in grid], ':', color='grey',
                        label='16P/N (ZeRO-3)')
            ax.plot(ns, [r['model_state_bytes']['max'] / MIB for r in rows], 'o-',
                    label='model state (measured)')
            med = [r['peak_bytes']['median'] / MIB for r in rows]
            err = [[m - r['peak_bytes']['min'] / MIB for m, r in zip(med, rows)],
                   [r['peak_bytes']['max'] / MIB - m for m, r in zip(med, rows)]]
            ax.errorbar(ns, med, yerr=err, fmt='s-', capsize=3, label='peak over a step')
            ax.set_title(label)
            ax.set_xscale('log', base=2)
            ax.set_xticks(grid, [str(n) for n in grid])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in axes[-1]:
            ax.set_xlabel('world size N')
        for ax in axes[:, 0]:
            ax.set_ylabel('MiB per rank')
        fig.suptitle(f'{model} ({_params(rows[0]["params"])} parameters, fp32 AdamW): '
                     'memory per rank vs world size')
        fig.tight_layout()
        name = f'memory_{model}.png'
        fig.savefig(os.path.join(img_dir, name), dpi=90)
        plt.close(fig)
        names.append(name)
    return names


def _plot_overhead(res: Results, img_dir: str) -> Optional[str]:
    rows = res.of('overhead')
    if not rows:
        return None
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    labels = [r['strategy'] for r in rows]
    med = [r['ratio']['median'] for r in rows]
    err = [[m - r['ratio']['min'] for m, r in zip(med, rows)],
           [r['ratio']['max'] - m for m, r in zip(med, rows)]]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar(labels, med, yerr=err, capsize=6, color='#4c72b0')
    ax.axhline(1.0, color='k', lw=0.8)
    ax.axhline(OVERHEAD_LIMIT, color='r', ls='--', lw=1, label=f'goal {OVERHEAD_LIMIT}')
    ax.set_ylabel('step time ratio, mmfsdp / hand-written torch')
    ax.set_title(f'Wrapper overhead (median, min–max over {rows[0]["steps"]} rounds)')
    lo = min(r['ratio']['min'] for r in rows)
    hi = max(r['ratio']['max'] for r in rows)
    ax.set_ylim(min(0.9, lo - 0.02), max(1.1, hi + 0.02))
    ax.legend()
    fig.tight_layout()
    name = 'overhead.png'
    fig.savefig(os.path.join(img_dir, name), dpi=90)
    plt.close(fig)
    return name


# ---------------------------------------------------------------------------- render

def _header(res: Results) -> List[str]:
    data, m = res.data, res.data['machine']
    out = data.get('out', f'benchmarks/results/{data["mode"]}.json')
    v = m['versions']
    wall = data.get('elapsed_s') or sum(j['wall_s'] for j in data.get('jobs', []))
    loads = [j['load_before'] for j in data.get('jobs', [])]
    lines = [
        '# Benchmarks', '',
        f'Generated by `python -m benchmarks.run --{data["mode"]}` (results: '
        f'`{out}`; `python -m benchmarks.report {out}` rewrites this page from them).', '',
        f'**Machine**: {m["cpu"]}, {m["cores"]} cores, {m["memory_gib"]} GiB RAM, no GPU; '
        f'Python {m["python"]}, torch {v.get("torch")}, mmengine {v.get("mmengine")}, '
        f'mmfsdp {v.get("mmfsdp")} (commit {m.get("commit")}); CPU + gloo. '
        f'{len(data.get("jobs", []))} torchrun jobs in {wall / 60:.1f} minutes'
        + (f'; 1-minute load average before each job {min(loads):.2f}–{max(loads):.2f} (it '
           "includes the suite's own previous job)." if loads else '.'), '']
    if data.get('note'):
        lines += [f'**Note on this run**: {data["note"]}', '']
    lines += [
        'Every figure is a median with its min–max over repeats: the measured training steps '
        'of one process for per-step figures, separate processes for construction peaks, '
        'repeated saves / resumes for checkpoints. Every measurement runs in its own torchrun '
        'job, so peaks and baselines belong to one case. "Per rank" is the maximum over the '
        'ranks.', '']
    models = res.models()
    if models:
        lines += ['**Workload**: the demo GPT (`mmfsdp.demo.GPT`, vocabulary 256, tied '
                  'embedding / LM head, fp32), AdamW, one FSDP unit per `TransformerBlock` '
                  '(plus the root), trained by `FSDPRunner` on the stdlib corpus.', '']
        rows = []
        for model in MODELS:
            r = next((x for x in res.all if x.get('model') == model and 'params' in x), None)
            if r:
                cfg = MODELS[model]
                rows.append([model, str(cfg['n_layer']), str(cfg['n_embd']), str(cfg['n_head']),
                             f'{r["params"]:,}'])
        lines += _table(['model', 'layers', 'width', 'heads', 'parameters P'], rows) + ['']
    return lines


def _goal_lines(res: Results) -> List[str]:
    rows = [[g, t, m, _mark(ok)] for g, t, m, ok in goals(res)]
    return ['## Goals', ''] + _table(['goal', 'target', 'measured', 'result'], rows) + ['']


#: Kinds measured again on their own (``python -m benchmarks.run --full --only KIND --out
#: benchmarks/results/FILE``): the report takes their rows from FILE unless the full run is newer.
REMEASURED = {'construction': 'construction.json'}
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')


def with_remeasured(data: Dict[str, Any], results_dir: str = RESULTS_DIR
                    ) -> Dict[str, Any]:
    """``data`` with the rows of every :data:`REMEASURED` kind taken from its own file.

    The file wins unless the full run is known to be newer (its ``started`` is
    later, or the file has none): rerunning the full suite must not be undone
    by an older re-measurement, nor a re-measurement by an older full run. The
    rows taken are marked with ``remeasured`` (the file's name, commit and loads).
    """
    import json
    out = dict(data)
    for kind, name in REMEASURED.items():
        path = os.path.join(results_dir, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            other = json.load(f)
        mine, theirs = data.get('started'), other.get('started')
        if mine is not None and (theirs is None or theirs < mine):
            continue
        loads = [j['load_before'] for j in other.get('jobs', []) if 'load_before' in j]
        source = dict(file=name, commit=other.get('machine', {}).get('commit', '?'),
                      loads=(min(loads), max(loads)) if loads else None)
        rows = [dict(r, remeasured=source) for r in other['results'] if r.get('kind') == kind]
        if rows:
            out['results'] = [r for r in out['results'] if r.get('kind') != kind] + rows
    return out


def render(data: Dict[str, Any], img_dir: Optional[str], img_rel: str = 'img',
           kept: str = '') -> str:
    """The report as Markdown; plots are written to ``img_dir`` (``None``: no plots).

    ``kept``: the marked sections other scripts wrote (:data:`KEPT`), placed
    after the numbered sections, before the observations. Kinds measured
    again on their own come from their files (:func:`with_remeasured`).
    """
    from . import accumulation, allocator, gpu_report, notes, peers_report
    res = Results(with_remeasured(data))
    lines = _header(res) + _goal_lines(res) + notes.failures(res)
    mem = res.of('memory')
    if mem:
        r0 = mem[0]
        lines += [
            '## 1. Model-state memory per rank', '',
            f'Bytes of the storages behind the local parameters, gradients and AdamW state, '
            f'counted right after `optimizer.step()` (gradients still alive), each storage '
            f'once; {r0["steps"]} measured steps after {r0.get("warmup", 1)} warm-up, batch '
            f'{r0["batch_size"]} × {r0["seq_len"]} tokens per rank. '
            'Bounds (fp32 AdamW, 16 bytes per parameter): '
            '16P (replicated), 16P/N (ZeRO-3: FULL_SHARD, FSDP2), 4P + 12P/N (ZeRO-2: '
            'parameters replicated, as the issue states it for SHARD_GRAD_OP). torch\'s '
            'SHARD_GRAD_OP and FSDP2 without resharding keep the parameters sharded between '
            'steps, so their model state sits at 16P/N, below the ZeRO-2 bound; they hold the '
            'gathered parameters from forward to backward instead, which shows in the peak '
            '(section 2). "plan" is `mmfsdp.plan.plan_for`\'s prediction on the meta-device '
            'model.', '']
        lines += _table(['model', 'strategy', 'N', 'measured MiB', 'params / grads / optim MiB',
                         'bound MiB', 'measured / bound', 'plan MiB'],
                        _memory_rows(res, _state_cells)) + ['']
        if img_dir:
            for name in _plot_memory(res, img_dir):
                lines += [f'![memory per rank]({img_rel}/{name})', '']
        lines += [
            '## 2. Peak memory per rank over a training step', '',
            "The process's peak resident set during one training iteration (the kernel's "
            'high-water mark, reset at the start of the iteration) minus its resident set '
            'before the model was built: model state, gathered parameters, activations, '
            'communication buffers and everything the allocator keeps. "vs DDP" divides by '
            'the DDP peak of the same model and world size. "plan peak" is the plan\'s '
            'estimate (model state + gathered units, activations excluded).', '']
        lines += _table(['model', 'strategy', 'N', 'peak MiB', 'model state MiB', 'vs DDP',
                         'plan peak MiB', 'step s'],
                        _memory_rows(res, _peak_cells(res))) + ['']
        lines += [
            '## 3. Communication per rank per step', '',
            'Ring-algorithm send volume per rank of every collective issued during one '
            'training step, from the sizes of the tensors passed (see Method); P·b is the '
            'parameter bytes (b = 4). At N = 1 nothing is sent.', '']
        lines += _table(['model', 'strategy', 'N', 'measured MiB', 'theory MiB',
                         'measured / theory', 'collectives per step'],
                        _memory_rows(res, _comm_cells)) + ['']
    lines += _overhead_lines(res, img_dir, img_rel)
    lines += _fsdp2_lines(res)
    lines += _checkpoint_lines(res)
    lines += _construction_lines(res)
    lines += accumulation.section_lines(accumulation.load())
    lines += allocator.section_lines(allocator.load())
    lines += gpu_report.gpu_lines(gpu_report.load())
    lines += peers_report.peers_lines(peers_report.load(), img_dir, img_rel,
                                      peers_report.load(peers_report.TENSOR_RESULTS))
    if kept:
        lines += [kept.strip('\n'), '']
    lines += notes.observations(res)
    lines += notes.method(res)
    return '\n'.join(lines).rstrip() + '\n'


def _overhead_lines(res: Results, img_dir: Optional[str], img_rel: str) -> List[str]:
    rows = res.of('overhead')
    if not rows:
        return []
    r0 = rows[0]
    lines = [
        '## 4. Wrapper overhead', '',
        f'{r0["model"]} at N = {r0["world_size"]}, batch {r0["batch_size"]} × {r0["seq_len"]} '
        f'tokens per rank. One process group runs both arms: an iteration of `FSDPRunner`\'s '
        'train loop (hooks, data preprocessor, the mmfsdp wrapper\'s `train_step`, '
        '`OptimWrapper.update_params`) and a hand-written step (forward, `backward()`, '
        '`AdamW.step()`, `zero_grad()`) on a second copy of the model wrapped with torch\'s '
        f'API and the same settings; {r0["warmup"]} warm-up steps each, then '
        f'{r0["steps"]} rounds of one step per arm, the order alternating every round, each '
        'step timed between two barriers. Ratio = mmfsdp / torch, per round.', '']
    lines += _table(['wrapper', 'mmfsdp step s', 'hand-written torch step s',
                     'ratio median (min–max)', 'mmfsdp − torch, ms per step',
                     f'≤ {OVERHEAD_LIMIT}'],
                    [[r['strategy'], _s(r['step_time_s']['mmfsdp'], fmt='{:.3f}'),
                      _s(r['step_time_s'][f'torch-{r["wrapper"]}'], fmt='{:.3f}'),
                      _s(r['ratio'], fmt='{:.3f}'),
                      _s(r['extra_s'], 1000, '{:+.0f}') if 'extra_s' in r else '—',
                      _mark(r['ratio']['median'] <= OVERHEAD_LIMIT)] for r in rows]) + ['']
    lines += ['The difference in milliseconds is what transfers to other hardware: it is the '
              'Python work of the runner loop, its hooks and the wrapper, which does not shrink '
              'with a faster device, so the same ratio on an accelerator, where a step of this '
              'model takes milliseconds, would be larger.', '']
    if img_dir:
        name = _plot_overhead(res, img_dir)
        if name:
            lines += [f'![wrapper overhead]({img_rel}/{name})', '']
    return lines


def _fsdp2_lines(res: Results) -> List[str]:
    timing = res.one('overhead', wrapper='fsdp2')
    rows = []
    for model in res.models():
        for n in res.world_sizes():
            one = res.one('memory', model=model, strategy='FSDP1 FULL_SHARD', world_size=n)
            two = res.one('memory', model=model, strategy='FSDP2 reshard', world_size=n)
            if one and two:
                def ratio(key: str, stat: str, fmt: str = '{:.3f}') -> str:
                    return fmt.format(two[key][stat] / one[key][stat])  # noqa: B023

                rows.append([model, str(n), ratio('peak_bytes', 'median'),
                             ratio('model_state_bytes', 'max'),
                             ratio('step_time_s', 'median', '{:.2f}')])
    if not rows and not timing:
        return []
    lines = ['## 5. FSDP2 vs FSDP1', '',
             'Same model, one unit per block, FULL_SHARD vs `reshard_after_forward=True`.']
    if timing:
        lines += ['', f'**Step time**, measured interleaved in one process group '
                  f'({timing["model"]}, N = {timing["world_size"]}, hand-written torch loops '
                  f'of both, {timing["steps"]} rounds): FSDP2 / FSDP1 = '
                  f'**{_s(timing["fsdp2_over_fsdp1"], fmt="{:.3f}")}** '
                  f'(FSDP2 {_s(timing["step_time_s"]["torch-fsdp2"], fmt="{:.3f}")} s, FSDP1 '
                  f'{_s(timing["step_time_s"]["torch-fsdp1"], fmt="{:.3f}")} s per step).']
    if rows:
        lines += ['', '**Memory** from sections 1-2 (separate jobs; the step-time column there '
                  'is from separate jobs too, so only indicative):', '']
        lines += _table(['model', 'N', 'peak FSDP2 / FSDP1', 'model state FSDP2 / FSDP1',
                         'step time FSDP2 / FSDP1 (separate jobs)'], rows)
    return lines + ['']


def _checkpoint_lines(res: Results) -> List[str]:
    from . import notes
    rows = res.of('checkpoint')
    if not rows:
        return []
    r0 = rows[0]
    cfg = MODELS[r0['model']]
    lines = [
        f'## 6. Checkpoint cost (world size {r0["world_size"]})', '',
        f'`python -m benchmarks.checkpoint_cost --model {r0["model"]}` (the suite runs the same '
        f'cases) — the demo GPT with {cfg["n_layer"]} blocks of width {cfg["n_embd"]} '
        f'({_params(r0["params"])} parameters, fp32, AdamW state after one step), FSDP1 '
        f'FULL_SHARD per `TransformerBlock`, {r0["world_size"]} CPU processes. Times are the '
        f'median (min–max) of {r0["save_s"]["n"]} saves and {r0["load_s"]["n"]} resumes '
        '(model + optimizer + schedulers); peak memory is rank 0\'s resident-set high-water '
        'mark, measured in a separate torchrun job per type, as the increase over its resident '
        'set just before the first save (resp. resume).', '']
    lines += _table(['type', 'save s', 'resume s', 'size MB', 'rank-0 peak during save',
                     'rank-0 peak during resume'],
                    [[r['type'], _s(r['save_s']), _s(r['load_s']), f'{r["bytes"] / 1e6:,.0f}',
                      f'+{_mib(r["rank0_peak_save_bytes"])} MiB',
                      f'+{_mib(r["rank0_peak_load_bytes"])} MiB'] for r in rows]) + ['']
    return lines + notes.checkpoint(res) + ['']


def _construction_lines(res: Results) -> List[str]:
    from .measure import summary
    rows = res.of('construction')
    if not rows:
        return []
    groups: Dict[Tuple[str, str, int], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get('wrapper', 'fsdp2'), r['init'], r['world_size']), []).append(r)
    r0 = rows[0]
    source = r0.get('remeasured')
    lines = ['## 7. Construction memory', '']
    if source:
        lines += [
            f'Measured on its own, `python -m benchmarks.run --full --only construction --out '
            f"benchmarks/results/{source['file']}` (commit {source['commit']}"
            + (f"; 1-minute load average before the jobs {source['loads'][0]:.1f}–"
               f"{source['loads'][1]:.1f}" if source['loads'] else '')
            + '); the other sections come from the full run.', '']
    lines += [
        f'{r0["model"]} ({_params(r0["params"])}) through `FSDPRunner` with '
        "`mmfsdp.MMFullyShard` (FSDP2) or `mmfsdp.MMFullyShardedDataParallel` (FSDP1, "
        'FULL_SHARD), one unit per block: eager (every rank builds and initialises the full '
        "model, then shards it) vs `init_device='meta'` (FSDP2: built on the meta device, "
        'sharded, then each rank allocates and initialises its shards; FSDP1: built on the meta '
        'device, materialised and initialised on the CPU, then moved to the device unit by unit '
        '— on a CPU-only machine the host *is* the device, so FSDP1 holds the full model either '
        'way; the bound is for the accelerator, where only the shards and a unit reach it). The '
        'peak is the resident-set high-water mark from before the model is built until '
        '`before_train` (model, wrapper and optimizer built; AdamW state is allocated at the first '
        'step), the maximum over ranks, median (min–max) over separate processes.', '']
    table = []
    for (wrapper, init, n), group in sorted(groups.items(),
                                            key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        g0 = group[0]
        peak = summary(r['peak_bytes'] for r in group)
        ok = peak['max'] <= g0['goal_bytes']
        goal = init == 'meta' and wrapper == 'fsdp2'
        table.append([wrapper.upper(), init, str(n), _s(peak, 1 / MIB, '{:,.1f}'),
                      _mib(g0['shard_bytes']),
                      _mib(g0['largest_unit_bytes']), _mib(g0['goal_bytes']),
                      _mib(g0['full_model_bytes']), _mib(g0['model_state_bytes']),
                      _mark(ok) if goal else ('within' if ok else 'above') +
                      (' (no goal)' if wrapper == 'fsdp2' else ' (CPU: the host is the device)')])
    lines += _table(['wrapper', 'init', 'N', 'peak MiB per rank', 'param shard MiB',
                     'largest unit MiB',
                     'shard + 2 × unit MiB', 'full model 4P MiB', 'model state 16P/N MiB',
                     'vs shard + 2 × unit'], table)
    return lines + ['']


def write_report(data: Dict[str, Any], path: str, img_dir: Optional[str] = None) -> None:
    """Write the report to ``path`` and its plots to ``img_dir`` (default: ``img/`` beside it)."""
    img_dir = img_dir or os.path.join(os.path.dirname(os.path.abspath(path)), 'img')
    os.makedirs(img_dir, exist_ok=True)
    rel = os.path.relpath(img_dir, os.path.dirname(os.path.abspath(path)))
    text = render(data, img_dir, rel, _kept_sections(path))  # read before it is rewritten
    with open(path, 'w') as f:
        f.write(text)


#: Sections that other benchmark scripts write between these markers; kept on rewrite.
KEPT = (('<!-- peak-truth:begin -->', '<!-- peak-truth:end -->'),
        ('<!-- compile-section:begin -->', '<!-- compile-section:end -->'),
        ('<!-- load-bytes-section:begin -->', '<!-- load-bytes-section:end -->'),
        ('<!-- async-save:begin -->', '<!-- async-save:end -->'))


def _kept_sections(path: str) -> str:
    """The marked sections of the report now at ``path`` (:data:`KEPT`)."""
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        return ''
    kept = [begin + old.split(begin, 1)[1].split(end, 1)[0] + end
            for begin, end in KEPT if begin in old and end in old]
    return '\n\n'.join(kept)


def main() -> None:
    """Command-line entry point."""
    import json
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('results')
    parser.add_argument('--out', default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), 'docs', 'benchmarks.md'))
    parser.add_argument('--img-dir')
    args = parser.parse_args()
    with open(args.results) as f:
        write_report(json.load(f), args.out, args.img_dir)


if __name__ == '__main__':
    main()
