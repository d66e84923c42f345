"""Does the plan predict the step peak? ``python -m benchmarks.peak_truth``.

Each case trains the demo GPT under one strategy, world size, activation
checkpointing setting and batch size through ``FSDPRunner``, measured as
:mod:`benchmarks.memory` measures it (the resident set's high-water mark of an
iteration above the resident set before the model was built; glibc with the 1 MiB
mmap threshold; maximum over ranks, median over iterations), and compares it with
``python -m mmfsdp.plan --device cpu``'s step peak for the same config, computed on
the meta-device model without running it. ``--cpu-allocator jemalloc`` (or
``tcmalloc``) measures under that malloc, preloaded as ``tools/dist_train.sh``
preloads it, and predicts with its heap. ``--repredict`` recomputes the
predictions of the cases in ``--out`` without measuring again.
Goal: |predicted - measured| <= 10 % of measured on every case. Block: ``peak-truth``.
"""
import argparse
from typing import Any, Dict, List, Optional

from .core import records
from .core.launch import preload_for, torchrun
from .core.workload import CHECKPOINT_BLOCKS, STRATEGIES, build_model, runner_cfg
from .memory import measure_steps

GOAL = 0.10
STRATEGY_NAMES = ['DDP', 'FSDP1 FULL_SHARD', 'FSDP2 reshard']


def wrapper_cfg_of(case: Dict[str, Any]) -> Dict[str, Any]:
    """The case's ``model_wrapper_cfg``."""
    cfg = dict(STRATEGIES[case['strategy']].wrapper_cfg)
    if case['ac']:
        cfg['activation_checkpointing'] = CHECKPOINT_BLOCKS
    return cfg


def predict(case: Dict[str, Any]) -> Dict[str, Any]:
    """The plan's step peak for a case (model on the meta device, batch from the config)."""
    from mmfsdp.plan import heap_threshold, plan_for, step_peak, trace_for
    from mmfsdp.plan.batch import config_batch
    from mmfsdp.registry import MODEL_WRAPPERS
    wrapper_cfg = wrapper_cfg_of(case)
    cfg = runner_cfg(case['model'], wrapper_cfg, '/nonexistent', case['name'],
                     case['batch_size'], case['seq_len'], 1)
    batch, size = config_batch(cfg.train_dataloader, 'mmengine')
    wrapper_cls = MODEL_WRAPPERS.get(wrapper_cfg['type'].split('.', 1)[-1])
    model = build_model(case['model'], 'meta')
    plan = plan_for(wrapper_cls, wrapper_cfg, model, case['world_size'], dict(type='AdamW'))
    heap = heap_threshold('cpu', case.get('cpu_allocator', 'glibc'))
    return step_peak(plan, trace_for(wrapper_cls, wrapper_cfg, model, batch), size,
                     heap).to_dict()


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: measure a case, then predict it."""
    measured = measure_steps(case, wrapper_cfg_of(case))
    return {} if measured is None else dict(case, **measured, predicted=predict(case))


def grid(models: List[str], world_sizes: List[int], batches: List[int],
         strategies: List[str], cpu_allocator: str = 'glibc') -> List[Dict[str, Any]]:
    """model x N x strategy x AC x batch (DDP without checkpointing)."""
    suffix = '' if cpu_allocator == 'glibc' else f'/{cpu_allocator}'
    return [dict(model=model, world_size=n, strategy=strategy, ac=ac, batch_size=batch,
                 seq_len=64, warmup=1, steps=2, cpu_allocator=cpu_allocator,
                 name=f"peak/{model}/N{n}/{strategy}/{'AC' if ac else 'no-AC'}/b{batch}{suffix}")
            for model in models for n in world_sizes for strategy in strategies
            for ac in ((False, True) if strategy != 'DDP' else (False, )) for batch in batches]


def error(r: Dict[str, Any]) -> float:
    """(predicted - measured) / measured."""
    measured = r['peak_bytes']['median']
    return (r['predicted']['peak_bytes'] - measured) / measured


def table(results: List[Dict[str, Any]]) -> str:
    """One row per case and the goal's verdict."""
    def parts(p: Dict[str, Any]) -> str:
        mib = records.mib
        return (f"{mib(p['model_state_bytes'])} + {mib(p['gathered_bytes'])} + "
                f"{mib(p['activation_bytes'])} ({mib(p['heap_activation_bytes'])}) + "
                f"max({mib(p['traced_transient_bytes'])}, {mib(p['staging_bytes'])})")

    rows = []
    for r in sorted(results, key=lambda r: (r['model'] != 'gpt-25m', r['model'], r['world_size'],
                                            r['strategy'], r['ac'], r['batch_size'])):
        err, s = error(r), r['peak_bytes']
        rows.append([r['model'], r['strategy'], r['world_size'], 'on' if r['ac'] else 'off',
                     r['batch_size'], f"{s['median'] / records.MIB:,.1f} "
                     f"({s['min'] / records.MIB:,.0f}–{s['max'] / records.MIB:,.0f})",
                     records.mib(r['predicted']['peak_bytes']), parts(r['predicted']),
                     f'{err:+.1%}', 'yes' if abs(err) <= GOAL else '**no**'])
    worst = max((abs(error(r)) for r in results), default=0.0)
    passed = sum(abs(error(r)) <= GOAL for r in results)
    return records.table(
        ['model', 'strategy', 'N', 'AC', 'batch', 'measured MiB', 'predicted MiB',
         'states + gathered + activations (heap) + max(traced transient, staging) MiB',
         'error', 'within 10 %'], rows) + (
        f'\n\n**{passed} of {len(results)} cases within 10 %** (largest error {worst:.1%}).')


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.peak_truth',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=['gpt-25m', 'gpt-100m'])
    parser.add_argument('--world-sizes', nargs='+', type=int, default=[1, 2, 4])
    parser.add_argument('--batch-sizes', nargs='+', type=int, default=[2, 8])
    parser.add_argument('--strategies', nargs='+', default=STRATEGY_NAMES,
                        choices=STRATEGY_NAMES)
    parser.add_argument('--cpu-allocator', default='glibc',
                        choices=['glibc', 'jemalloc', 'tcmalloc'])
    parser.add_argument('--resume', action='store_true', help='keep the cases already in --out')
    parser.add_argument('--repredict', action='store_true',
                        help='only recompute the predictions of the cases in --out')
    records.add_output_options(parser, 'peak_truth')
    args = parser.parse_args(argv)
    results = records.load_results(args.out) if args.resume or args.repredict else []
    if args.repredict:
        results = [dict(r, predicted=predict(r)) for r in results]
    else:
        done = {r['name'] for r in results}
        glibc = args.cpu_allocator == 'glibc'
        env = {} if glibc else preload_for(args.cpu_allocator)
        for case in grid(args.models, args.world_sizes, args.batch_sizes, args.strategies,
                         args.cpu_allocator):
            if case['name'] not in done:
                results += torchrun('peak_truth', [case], case['world_size'], memory=glibc,
                                    env=env)
                records.save_results(args.out, results)
    records.save_results(args.out, results)
    records.finish(args, {'peak-truth': records.header('python -m benchmarks.peak_truth')
                          + '\n\n' + table(results)})


if __name__ == '__main__':
    main()
