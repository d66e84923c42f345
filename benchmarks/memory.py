"""Model state, peak memory and communication per rank per step: ``python -m benchmarks.memory``.

One torchrun job per case (model, strategy, world size N), trained through
``FSDPRunner`` with the mmfsdp wrapper; a hook measures every iteration:

- **model state**: the storages of the local parameters, gradients and AdamW state,
  counted right after ``optimizer.step()`` (gradients still alive);
- **peak**: the resident set's high-water mark during the iteration (reset at its
  start) minus the resident set before the model was built, after a warm-up step of
  the tiny GPT under the same wrapper (:func:`benchmarks.core.workload.warm_up`);
- **communication**: the ring send volume of every collective of the iteration
  (DDP's buckets go through its default all-reduce hook so that they are counted).

The first ``--warmup`` iterations are dropped (AdamW allocates its state in the
first); each figure is the maximum over ranks, summarised over iterations.
Blocks: ``model-state``, ``peak``, ``comm``, ``fsdp2-vs-fsdp1``.
"""
import argparse
import math
import tempfile
import time
from typing import Any, Dict, List, Optional

from .core import records
from .core.launch import torchrun
from .core.measure import (
    CollectiveCounter,
    ddp_counting_hook,
    model_state_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    summary,
)
from .core.records import mib, spread
from .core.workload import (
    BYTES_PER_ELEMENT,
    STRATEGIES,
    build_model,
    make_runner,
    parameter_count,
    runner_cfg,
    warm_up,
)


def step_probe(counter: CollectiveCounter) -> Any:
    """A hook recording, per training iteration, time, peak RSS, model state and collectives."""
    import torch
    from mmengine.hooks import Hook
    from torch.nn.parallel import DistributedDataParallel

    class StepProbe(Hook):
        def __init__(self) -> None:
            self.records: List[Dict[str, Any]] = []
            self.state: Dict[str, int] = {}

        def before_train(self, runner: Any) -> None:
            model = runner.model
            if isinstance(model, DistributedDataParallel):
                model.register_comm_hook(None, ddp_counting_hook)

            def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                self.state = model_state_bytes(model, opt)

            runner.optim_wrapper.optimizer.register_step_post_hook(after_step)

        def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
            counter.reset()
            reset_peak_rss()
            self.start = time.perf_counter()

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                             outputs: Any = None) -> None:
            self.records.append(dict(time_s=time.perf_counter() - self.start,
                                     peak_bytes=peak_rss_bytes(), state=dict(self.state),
                                     comm=counter.snapshot(), loss=outputs['loss'].item()))

    return StepProbe()


def plan_bytes(strategy: str, preset: str, world_size: int) -> Dict[str, Any]:
    """``mmfsdp.plan``'s prediction for this case (model on the meta device)."""
    from mmfsdp.plan import plan_for
    from mmfsdp.registry import MODEL_WRAPPERS
    cfg = dict(STRATEGIES[strategy].wrapper_cfg)
    wrapper_cls = MODEL_WRAPPERS.get(cfg['type'].split('.', 1)[-1])
    plan = plan_for(wrapper_cls, cfg, build_model(preset, 'meta'), world_size, dict(type='AdamW'))
    return dict(model_state_bytes=plan.model_state_bytes_per_rank,
                peak_estimate_bytes=plan.peak_bytes_per_rank_estimate)


def measure_steps(case: Dict[str, Any], wrapper_cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Train one case under ``wrapper_cfg``; rank 0 gets the per-step maxima over ranks.

    Also used by :mod:`benchmarks.peak_truth`.
    """
    import torch.distributed as dist
    if case.get('warm_up', True):
        warm_up(wrapper_cfg, case['name'])
    baseline = rss_bytes()  # before the model is built
    counter = CollectiveCounter()
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir, counter:
        cfg = runner_cfg(case['model'], wrapper_cfg, work_dir, case['name'],
                         case['batch_size'], case['seq_len'], case['warmup'] + case['steps'])
        runner = make_runner(cfg)
        probe = step_probe(counter)
        runner.register_hook(probe, priority='VERY_LOW')
        runner.train()
        del runner
    measured = probe.records[case['warmup']:]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(baseline=baseline, records=measured))
    if dist.get_rank():
        return None

    def per_step(fn: Any) -> List[float]:
        return [max(fn(g, g['records'][i]) for g in gathered) for i in range(len(measured))]

    return dict(
        peak_bytes=summary(per_step(lambda g, r: r['peak_bytes'] - g['baseline'])),
        model_state_bytes=summary(per_step(lambda g, r: r['state']['total'])),
        model_state_parts=measured[-1]['state'],
        comm_send_bytes=summary(per_step(lambda g, r: r['comm']['send_bytes'])),
        comm_by_op=measured[-1]['comm']['by_op'],
        step_time_s=summary(r['time_s'] for r in measured),
        loss_finite=all(math.isfinite(r['loss']) for r in measured))


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: measure one case; rank 0 returns the result."""
    import torch.distributed as dist
    measured = measure_steps(case, STRATEGIES[case['strategy']].wrapper_cfg)
    if measured is None:
        return {}
    n = dist.get_world_size()
    return dict(case, **measured, world_size=n, params=parameter_count(case['model']),
                plan=plan_bytes(case['strategy'], case['model'], n))


def plan_cases(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every strategy at N > 1; at N = 1 only DDP (FSDP does not shard there)."""
    return [dict(model=model, strategy=label, world_size=n, batch_size=args.batch_size,
                 seq_len=args.seq_len, warmup=args.warmup, steps=args.steps,
                 name=f'memory/{model}/N{n}/{label}')
            for model in args.models for n in args.world_sizes for label in args.strategies
            if n > 1 or label == 'DDP']


def _model(r: Dict[str, Any]) -> str:
    return f"{r['model']} ({r['params'] / 1e6:.1f}M)"


def tables(results: List[Dict[str, Any]]) -> Dict[str, str]:
    """The four blocks of the docs page."""
    order = list(STRATEGIES)
    results = sorted(results, key=lambda r: (r['params'], order.index(r['strategy']),
                                             r['world_size']))
    ddp = {(r['model'], r['world_size']): r['peak_bytes']['median'] for r in results
           if r['strategy'] == 'DDP'}
    state, peak, comm = [], [], []
    for r in results:
        s, n, p = STRATEGIES[r['strategy']], r['world_size'], r['params']
        first = [_model(r), r['strategy'], n]
        parts, bound = r['model_state_parts'], s.state_bytes_per_param(n) * p
        measured = r['model_state_bytes']['median']
        state.append(first + [mib(measured), ' / '.join(mib(parts[k]) for k in (
            'params', 'grads', 'optimizer')), f'{mib(bound)} ({s.state_bound})',
            f'{measured / bound:.3f}', mib(r['plan']['model_state_bytes'])])
        base = ddp.get((r['model'], n))
        peak.append(first + [spread(r['peak_bytes'], '{:,.1f}', 1 / records.MIB),
                             mib(measured), f"{r['peak_bytes']['median'] / base:.3f}"
                             if base else '—', mib(r['plan']['peak_estimate_bytes']),
                             spread(r['step_time_s'])])
        theory = s.comm_factor(n) * p * BYTES_PER_ELEMENT
        sent = r['comm_send_bytes']['median']
        comm.append(first + [mib(sent), f'{mib(theory)} ({s.comm_formula})',
                             f'{sent / theory:.4f}' if theory else '—',
                             ', '.join(f"{op} ×{v['calls']}"
                                       for op, v in r['comm_by_op'].items())])
    by = {(r['model'], r['world_size'], r['strategy']): r for r in results}
    versus = []
    for (model, n, label), two in by.items():
        one = by.get((model, n, 'FSDP1 FULL_SHARD'))
        if label == 'FSDP2 reshard' and one:
            versus.append([model, n] + [f"{two[k]['median'] / one[k]['median']:.{d}f}" for k, d in (
                ('peak_bytes', 3), ('model_state_bytes', 3), ('step_time_s', 2))])
    return {
        'model-state': records.table(
            ['model', 'strategy', 'N', 'measured MiB', 'params / grads / optim MiB', 'bound MiB',
             'measured / bound', 'plan MiB'], state),
        'peak': records.table(['model', 'strategy', 'N', 'peak MiB', 'model state MiB',
                               'vs DDP', 'plan peak MiB', 'step s'], peak),
        'comm': records.table(['model', 'strategy', 'N', 'measured MiB', 'theory MiB',
                               'measured / theory', 'collectives per step'], comm),
        'fsdp2-vs-fsdp1': records.table(
            ['model', 'N', 'peak FSDP2 / FSDP1', 'model state FSDP2 / FSDP1',
             'step time FSDP2 / FSDP1 (separate jobs)'], versus)}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.memory',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=['gpt-25m', 'gpt-100m'])
    parser.add_argument('--world-sizes', nargs='+', type=int, default=[1, 2, 4])
    parser.add_argument('--strategies', nargs='+', default=list(STRATEGIES),
                        choices=list(STRATEGIES), metavar='STRATEGY',
                        help=f'labels of {list(STRATEGIES)}')
    parser.add_argument('--batch-size', type=int, default=2, help='sequences per rank')
    parser.add_argument('--seq-len', type=int, default=64)
    parser.add_argument('--warmup', type=int, default=1, help='iterations not measured')
    parser.add_argument('--steps', type=int, default=3, help='iterations measured')
    parser.add_argument('--resume', action='store_true', help='keep the cases already in --out')
    records.add_output_options(parser, 'memory')
    args = parser.parse_args(argv)
    results = records.load_results(args.out) if args.resume else []
    done = {r['name'] for r in results}
    for case in plan_cases(args):
        if case['name'] not in done:
            results += torchrun('memory', [case], case['world_size'])
            records.save_results(args.out, results)
    blocks = tables(results)
    blocks['model-state'] = (records.header('python -m benchmarks.memory') + '\n\n'
                             + blocks['model-state'])
    records.finish(args, blocks)


if __name__ == '__main__':
    main()
