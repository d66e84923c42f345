"""Peak memory per rank while building and sharding a model, eager vs meta init:
``python -m benchmarks.construction``.

One torchrun job per (world size, wrapper, init, repeat): ``FSDPRunner`` builds the
GPT with mmfsdp's FSDP2 or FSDP1 (FULL_SHARD) wrapper, one unit per block, eagerly
or with ``init_device='meta'``, and ``train()`` runs zero iterations (model,
wrapper and optimizer built; AdamW allocates its state at the first step). The
peak is the resident set's high-water mark up to ``before_train`` minus the
resident set before the model was built (after a warm-up step of the tiny GPT),
the maximum over ranks, the median over the jobs. Block: ``construction``.
"""
import argparse
import math
import tempfile
from typing import Any, Dict, List, Optional

from .core import records
from .core.launch import torchrun
from .core.measure import model_state_bytes, peak_rss_bytes, reset_peak_rss, summary
from .core.records import mib
from .core.workload import (
    BYTES_PER_ELEMENT,
    build_model,
    fsdp1_cfg,
    fsdp2_cfg,
    make_runner,
    runner_cfg,
    warm_up,
)

WRAPPERS = {'fsdp1': fsdp1_cfg, 'fsdp2': fsdp2_cfg}


def bounds(preset: str, world_size: int, wrapper: str) -> Dict[str, int]:
    """The goal's terms in bytes: this rank's parameter shard (FSDP2 pads every parameter's
    dim 0 to a multiple of N, FSDP1 each unit's flat parameter) and the largest unit."""
    model = build_model(preset, 'meta')
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    units = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    if wrapper == 'fsdp1':
        shard = sum(math.ceil(u / world_size) for u in units + [root])
    else:
        shard = sum(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0])
                    for p in model.parameters())
    params = sum(units) + root
    return dict(shard_bytes=shard * BYTES_PER_ELEMENT,
                largest_unit_bytes=max(units + [root]) * BYTES_PER_ELEMENT,
                full_model_bytes=params * BYTES_PER_ELEMENT,
                model_state_bytes=16 * params // world_size)


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: build and shard the model; rank 0 returns the worst rank's peak."""
    import torch.distributed as dist
    from mmengine.hooks import Hook

    class Probe(Hook):
        def before_train(self, runner: Any) -> None:
            self.peak = peak_rss_bytes()
            self.params = model_state_bytes(runner.model, None)['params']

    wrapper_cfg = WRAPPERS[case['wrapper']]()
    if case['init'] == 'meta':
        wrapper_cfg['init_device'] = 'meta'
    warm_up(wrapper_cfg, case['name'])
    baseline = reset_peak_rss()
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir:
        runner = make_runner(runner_cfg(case['model'], wrapper_cfg, work_dir, case['name'],
                                        1, 16, 0))
        probe = Probe()
        runner.register_hook(probe)
        runner.train()
        del runner
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, probe.peak - baseline)
    if dist.get_rank():
        return {}
    return dict(case, world_size=len(gathered), peak_bytes=max(gathered),
                **bounds(case['model'], len(gathered), case['wrapper']))


def table(results: List[Dict[str, Any]]) -> str:
    """One row per (N, wrapper, init): the median over its jobs against the bound."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r['world_size'], r['wrapper'], r['init']), []).append(r)
    rows = []
    for (n, wrapper, init), rs in sorted(groups.items()):
        r, peak = rs[0], summary(x['peak_bytes'] for x in rs)
        goal = r['shard_bytes'] + 2 * r['largest_unit_bytes']
        if peak['median'] <= goal:
            verdict = '**pass**' if wrapper == 'fsdp2' and init == 'meta' else 'below'
        else:
            verdict = ('above (CPU: the host is the device)' if wrapper == 'fsdp1' else
                       'above (no goal)' if init == 'eager' else '**fail**')
        rows.append([wrapper.upper(), init, n, records.spread(peak, '{:,.1f}', 1 / records.MIB),
                     mib(r['shard_bytes']), mib(r['largest_unit_bytes']), mib(goal),
                     mib(r['full_model_bytes']), mib(r['model_state_bytes']), verdict])
    return records.table(['wrapper', 'init', 'N', 'peak MiB per rank', 'param shard MiB',
                          'largest unit MiB', 'shard + 2 × unit MiB', 'full model 4P MiB',
                          'model state 16P/N MiB', 'vs shard + 2 × unit'], rows)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.construction',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--world-sizes', nargs='+', type=int, default=[2, 4])
    parser.add_argument('--wrappers', nargs='+', default=['fsdp1', 'fsdp2'], choices=WRAPPERS)
    parser.add_argument('--inits', nargs='+', default=['eager', 'meta'], choices=['eager', 'meta'])
    parser.add_argument('--repeats', type=int, default=2, help='separate jobs per case')
    records.add_output_options(parser, 'construction')
    args = parser.parse_args(argv)
    results = []
    for n in args.world_sizes:
        for wrapper in args.wrappers:
            for init in args.inits:
                for repeat in range(args.repeats):
                    case = dict(model=args.model, wrapper=wrapper, init=init,
                                name=f'construction/N{n}/{wrapper}/{init}/{repeat}')
                    results += torchrun('construction', [case], n)
                    records.save_results(args.out, results)
    records.finish(args, {'construction': records.header('python -m benchmarks.construction')
                          + '\n\n' + table(results)})


if __name__ == '__main__':
    main()
