"""What fp32 norms cost: FSDP2 bf16 with its norms in fp32 against FSDP1's default mixed
precision and DDP with autocast, interleaved in one process group:
``.venv-zoo/bin/python -m benchmarks.fp32_norms`` (torchvision's ResNet-50 and Swin-T need the
zoo environment; elsewhere they are skipped, said so, and the ``tests/support`` models run).

Per model, one torchrun job of N = 2 CPU processes (gloo) builds every configuration from the
same initial weights and the same per-rank batch, wrapped by mmfsdp's ``from_options``, one
``fully_shard`` / FSDP1 unit per block (plus the root), AdamW:

- ``DDP autocast``: fp32 parameters, ``torch.autocast('cpu', bfloat16)`` around the forward;
- ``FSDP1 default``: ``mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32')``, whose
  default keeps every ``_BatchNorm`` in fp32 (FSDP1 wraps each one as a unit of its own);
- ``FSDP1 norms fp32`` (models whose norms are not batch norms): the same norms as FSDP2 kept;
- ``FSDP2 norms fp32``: the same mixed precision, ``fp32_modules`` the model's norm classes
  (the kept norms inside one unit are one group);
- ``FSDP2 norms fp32, a group each``: the same, each kept norm a group of its own (as before
  mmfsdp grouped them: ``_fp32_groups`` replaced for the build);
- ``FSDP2 norms bf16`` (models whose norms are not batch norms): ``fp32_modules=[]``, no extra
  groups: what the norm groups cost, directly.

After ``--warmup`` steps of each, one more step of each is counted (every collective issued
through a ``ProcessGroup``; DDP's buckets through torch's default all-reduce hook, registered
on it for the whole run), then ``--rounds`` rounds run one step of each, the order reversed
every other round, each step timed between two barriers. A step is forward, loss, backward,
``AdamW.step()``, ``zero_grad()`` (the optimizer's part also timed alone, on rank 0). The
ratio of a round is a configuration's step over the FSDP1 default step of the same round; the
table gives the median (min-max) over the rounds. The job also times a small all-gather and
reduce-scatter (the per-collective latency of the group). Block: ``fp32-norms``.
"""
import argparse
import importlib
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from .core import records
from .core.launch import JobFailed, error_line, torchrun
from .core.measure import summary
from .core.records import spread

N = 2
GOAL = 1.05
BASE = 'FSDP1 default'
BF16 = dict(param_dtype='bf16', reduce_dtype='fp32')
#: FSDP2 as before the norms of one unit shared a group: one group per kept norm.
EACH = 'FSDP2 norms fp32, a group each'
#: name -> (how to build it, its block classes, the norm classes it keeps in fp32, needs)
MODELS: Dict[str, Any] = {
    'ResNet-50': ("torchvision.models.resnet50()", ['Bottleneck'], ['_BatchNorm'],
                  'torchvision'),
    'Swin-T': ("torchvision.models.swin_t()", ['SwinTransformerBlock', 'PatchMerging'],
               ['LayerNorm'], 'torchvision'),
    'BottleneckResNet': ("vision.BottleneckResNet(width=8)", ['Bottleneck'], ['_BatchNorm'],
                         'vision'),
    'TinyViT': ("vision.TinyViT(dim=64, depth=4, size=64)", ['EncoderLayer'], ['LayerNorm'],
                'vision'),
}


def _configs(blocks: List[str], norms: List[str]) -> Dict[str, Any]:
    """Configuration name -> (wrapper class name, options); ``None`` options: DDP."""
    policy = dict(type='transformer', layer_cls=blocks)
    batch_norms = norms == ['_BatchNorm']
    out: Dict[str, Any] = {'DDP autocast': ('MMDistributedDataParallel', None),
                           BASE: ('MMFullyShardedDataParallel',
                                  dict(auto_wrap_policy=policy, mixed_precision=BF16))}
    if not batch_norms:
        out['FSDP1 norms fp32'] = ('MMFullyShardedDataParallel', dict(
            auto_wrap_policy=policy, mixed_precision=dict(BF16, fp32_modules=norms)))
    out['FSDP2 norms fp32'] = ('MMFullyShard', dict(
        auto_wrap_policy=policy, mixed_precision=dict(BF16, fp32_modules=norms)))
    out[EACH] = out['FSDP2 norms fp32']
    if not batch_norms:
        out['FSDP2 norms bf16'] = ('MMFullyShard', dict(
            auto_wrap_policy=policy, mixed_precision=dict(BF16, fp32_modules=[])))
    return out


def _import(needs: str) -> Any:
    """``torchvision``, or ``tests/support/vision.py``."""
    if needs == 'vision':
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
            __file__))), 'tests', 'support'))
    return importlib.import_module(needs)


def _latency(op: str, repeats: int = 50) -> float:
    """Median seconds of one all-gather / reduce-scatter of 1,024 floats per rank."""
    import torch
    import torch.distributed as dist
    part = torch.ones(1024)
    full = torch.empty(1024 * dist.get_world_size())
    call = (lambda: dist.all_gather_into_tensor(full, part)) if op == 'all-gather' else (
        lambda: dist.reduce_scatter_tensor(part, full))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return summary(times)['median']


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: every configuration of one model, interleaved."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import mmfsdp
    from mmfsdp.wrappers import fsdp2

    from .core.measure import CollectiveCounter, ddp_counting_hook
    expression, blocks, norms, needs = MODELS[case['model']]
    namespace = {needs: _import(needs)}
    size, rank = case['size'], dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(case['batch'], 3, size, size, generator=g)
    y = torch.randint(0, 4, (case['batch'], ), generator=g)
    steps: Dict[str, Callable[[], Any]] = {}
    for name, (cls, options) in _configs(blocks, norms).items():
        if name not in case['configs']:
            continue
        torch.manual_seed(0)
        model = eval(expression, namespace)
        wrapper = getattr(mmfsdp, cls)
        if options is None:
            model = wrapper.from_options(model)
            model.register_comm_hook(None, ddp_counting_hook)
        else:
            grouped = fsdp2._fp32_groups
            if name == EACH:  # the layout before the norms of a unit were grouped
                fsdp2._fp32_groups = lambda *a, f=grouped: [[n] for g in f(*a) for n in g]
            try:
                model = wrapper.from_options(model, **options)
            finally:
                fsdp2._fp32_groups = grouped
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        autocast = options is None

        def step(model: Any = model, optimizer: Any = optimizer, autocast: bool = autocast
                 ) -> float:
            with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
                out = model(x)
            F.cross_entropy(out.float()[:, :4], y).backward()
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start  # this rank's optimizer time

        steps[name] = step
    names = list(steps)
    for _ in range(case['warmup']):
        for name in names:
            steps[name]()
    collectives: Dict[str, Dict[str, int]] = {}
    for name in names:
        with CollectiveCounter() as counter:
            steps[name]()
        collectives[name] = {op: int(v['calls']) for op, v in counter.snapshot()['by_op'].items()}
    times: Dict[str, List[float]] = {name: [] for name in names}
    optimizer_times: Dict[str, List[float]] = {name: [] for name in names}
    for i in range(case['rounds']):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            start = time.perf_counter()
            optimizer_times[name].append(steps[name]())
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    latency = {op: _latency(op) for op in ('all-gather', 'reduce-scatter')}
    if dist.get_rank():
        return {}
    return dict(case, times=times, optimizer_times=optimizer_times, collectives=collectives,
                latency=latency)


def tables(results: List[Dict[str, Any]], skipped: Dict[str, str]) -> Dict[str, str]:
    """The ``fp32-norms`` block."""
    rows = []
    for r in results:
        base = r['times'][BASE]
        for name, times in r['times'].items():
            ratio = summary(a / b for a, b in zip(times, base))
            calls = r['collectives'][name]
            counted = ' + '.join(f'{sum(n for op, n in calls.items() if key in op)} {label}'
                                 for key, label in (('gather', 'AG'), ('scatter', 'RS'),
                                                    ('allreduce', 'AR'))
                                 if any(key in op for op in calls))
            verdict = ('' if not name.startswith('FSDP2') else
                       ' **pass**' if ratio['median'] <= GOAL else ' **fail**')
            rows.append([r['model'], name, counted or '—',
                         spread(summary(times), '{:.3f}'),
                         spread(summary(r['optimizer_times'][name]), '{:.3f}'),
                         spread(ratio, '{:.3f}') + verdict])
    lat = [r['latency'] for r in results]
    text = records.header('python -m benchmarks.fp32_norms') + '\n\n' + records.table(
        ['model', 'configuration', 'collectives per step', 'step s', 'of which optimizer s',
         f'step / {BASE} (goal for FSDP2 ≤ {GOAL})'], rows)
    if lat:
        text += ('\n\nOne all-gather / reduce-scatter of 1,024 floats per rank in the same jobs: '
                 + ', '.join(f"{1e3 * v['all-gather']:.2f} / {1e3 * v['reduce-scatter']:.2f} ms"
                             for v in lat) + '.')
    for model, why in skipped.items():
        text += f'\n\n{model}: not run ({why}).'
    return {'fp32-norms': text}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.fp32_norms',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=['ResNet-50', 'Swin-T'],
                        choices=list(MODELS))
    parser.add_argument('--batch', type=int, default=2, help='images per rank')
    parser.add_argument('--size', type=int, default=64, help='image height and width')
    parser.add_argument('--warmup', type=int, default=2, help='untimed steps of each')
    parser.add_argument('--rounds', type=int, default=10, help='timed rounds')
    parser.add_argument('--configs', nargs='+', default=None,
                        help='a subset of the configurations (default: all)')
    parser.add_argument('--retable', action='store_true',
                        help='write the tables from the results in --out, measuring nothing')
    records.add_output_options(parser, 'fp32_norms')
    args = parser.parse_args(argv)
    results, skipped = (records.load_results(args.out) if args.retable else []), {}
    for model in [] if args.retable else args.models:
        needs = MODELS[model][3]
        try:
            _import(needs)
        except ImportError as missing:
            skipped[model] = f'{missing}; run it with .venv-zoo/bin/python'
            continue
        expression, blocks, norms, _ = MODELS[model]
        configs = args.configs or list(_configs(blocks, norms))
        case = dict(model=model, batch=args.batch, size=args.size, warmup=args.warmup,
                    rounds=args.rounds, configs=[BASE] + [c for c in configs if c != BASE])
        try:
            results += torchrun('fp32_norms', [case], N, memory=False)
        except JobFailed as failed:
            skipped[model] = error_line(failed)
        records.save_results(args.out, results)
    records.finish(args, tables(results, skipped))


if __name__ == '__main__':
    main()
