"""Regional vs whole-step compile and activation checkpointing: ``python -m benchmarks.compile``.

A ViT and a ResNet-50-style model (bottleneck blocks [3, 4, 6, 3]), fp32, trained
by ``FSDPRunner`` under FSDP2 (one unit per block) on 2 CPU ranks (gloo), one
torchrun job per case, each with an empty inductor cache (every compile is cold):

- **step time**: eager, whole-step compile (mmengine's ``compile=True``) and regional
  compile (``regional_compile=dict(layer_cls=[block])``). The steady step is the median
  over the measured iterations (the slowest rank per iteration); the compile time is
  what the warm-up iterations took beyond as many steady steps.
- **peak per rank**: no / full / selective checkpointing of the blocks (eager), and
  regional compile without and with ``mode='memory_budget'``: the resident set's
  high-water mark of an iteration above the resident set before the model was built
  (after one step of a tiny model of the same classes), glibc with the 1 MiB mmap
  threshold.

Goal: regional steady step <= whole-step's, regional compile time <= 0.5 x whole-step's.
Block: ``compile``.
"""
import argparse
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from .core import records
from .core.launch import JobFailed, error_line, load_average, torchrun
from .core.measure import peak_rss_bytes, reset_peak_rss, rss_bytes, summary
from .core.records import spread
from .core.workload import make_runner

#: Model sizes: ``full`` for the docs, ``tiny`` for ``--quick`` and the memory warm-up.
SIZES = {
    'vit': dict(full=dict(image=112, dim=384, depth=8, heads=6, batch=8),
                tiny=dict(image=32, dim=32, depth=2, heads=2, batch=2)),
    'resnet50': dict(full=dict(image=96, width=32, depths=(3, 4, 6, 3), batch=8),
                     tiny=dict(image=32, width=4, depths=(1, 1, 1, 1), batch=2)),
}
BLOCK = dict(vit='ViTBlock', resnet50='Bottleneck')
TIME_ARMS = ('eager', 'whole-step compile', 'regional compile')
MEMORY_ARMS = ('no checkpointing', 'full', 'selective', 'regional compile',
               'regional compile + memory_budget 0.5')
CLASSES = 100
NPROC = 2


class ViTBlock(nn.Module):
    """Pre-norm transformer encoder block: attention then MLP, each residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 reduce, 3x3 (strided), 1x1 expand x4, projection shortcut."""

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        cout = 4 * planes

        def conv_bn(i: int, o: int, k: int, s: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(i, o, k, s, k // 2, bias=False), nn.BatchNorm2d(o))

        self.body = nn.Sequential(conv_bn(cin, planes, 1), nn.ReLU(),
                                  conv_bn(planes, planes, 3, stride), nn.ReLU(),
                                  conv_bn(planes, cout, 1))
        self.shortcut = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + (x if self.shortcut is None else self.shortcut(x)))


class Classifier(BaseModel):
    """A stem, blocks, a head and cross-entropy: ``mode='loss'`` as mmengine calls it."""

    def __init__(self, arch: str, image: int, batch: int, data_preprocessor: Any = None,
                 **size: Any) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.arch = arch
        if arch == 'vit':
            dim, tokens = size['dim'], (image // 16) ** 2 + 1
            self.stem = nn.Conv2d(3, dim, 16, 16)
            self.cls = nn.Parameter(torch.zeros(1, 1, dim))
            self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
            self.blocks = nn.Sequential(*(ViTBlock(dim, size['heads'])
                                          for _ in range(size['depth'])))
            self.norm, out = nn.LayerNorm(dim), dim
        else:
            width = size['width']
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                      nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], width
            for stage, depth in enumerate(size['depths']):
                for i in range(depth):
                    blocks.append(Bottleneck(cin, width * 2 ** stage,
                                             2 if i == 0 and stage > 0 else 1))
                    cin = 4 * width * 2 ** stage
            self.blocks, out = nn.Sequential(*blocks), cin
        self.head = nn.Linear(out, CLASSES)

    def forward(self, inputs: torch.Tensor, data_samples: Any = None, mode: str = 'tensor'):
        x = self.stem(inputs)
        if self.arch == 'vit':
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)],
                          1) + self.pos
            x = self.norm(self.blocks(x))[:, 0]
        else:
            x = self.blocks(x).mean((2, 3))
        logits = self.head(x)
        return dict(loss=F.cross_entropy(logits, data_samples)) if mode == 'loss' else logits


class Images(torch.utils.data.Dataset):
    """Random images (a generator per index) with labels."""

    def __init__(self, image: int, length: int = 256) -> None:
        self.image, self.length = image, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Dict[str, Any]:
        gen = torch.Generator().manual_seed(i)
        return dict(inputs=torch.randn(3, self.image, self.image, generator=gen),
                    data_samples=i % CLASSES)


def wrapper_cfg(model: str, arm: str) -> Dict[str, Any]:
    """FSDP2, one unit per block, with the arm's layer options."""
    block = [BLOCK[model]]
    cfg = dict(type='mmfsdp.MMFullyShard',
               auto_wrap_policy=dict(type='transformer', layer_cls=block))
    if 'regional compile' in arm:
        cfg['regional_compile'] = dict(layer_cls=block)
    if arm in ('full', 'selective'):
        cfg['activation_checkpointing'] = dict(layer_cls=block, mode=arm)
    if 'memory_budget' in arm:
        cfg['activation_checkpointing'] = dict(mode='memory_budget', memory_budget=0.5)
    return cfg


def runner_cfg(case: Dict[str, Any], work_dir: str, size: Dict[str, Any], iters: int) -> Any:
    """An FSDPRunner config of the case's model and arm on random images."""
    from mmengine.config import Config
    from mmengine.registry import DATASETS, MODELS
    MODELS.register_module('CompileBenchClassifier', module=Classifier, force=True)
    DATASETS.register_module('CompileBenchImages', module=Images, force=True)
    return Config(dict(
        model=dict(type='CompileBenchClassifier', arch=case['model'], **size),
        work_dir=work_dir, launcher='pytorch', log_level='WARNING',
        runner_type='mmfsdp.FSDPRunner',
        model_wrapper_cfg=wrapper_cfg(case['model'], case['arm']),
        compile=case['arm'] == 'whole-step compile', randomness=dict(seed=0),
        env_cfg=dict(dist_cfg=dict(timeout=1800)),
        train_dataloader=dict(dataset=dict(type='CompileBenchImages', image=size['image']),
                              sampler=dict(type='DefaultSampler', shuffle=True),
                              collate_fn=dict(type='default_collate'),
                              batch_size=size['batch'], num_workers=0),
        train_cfg=dict(by_epoch=False, max_iters=iters),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-4)),
        default_hooks=dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1000))))


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: train one case; rank 0 returns its summary."""
    import torch.distributed as dist
    from mmengine.hooks import Hook
    from torch._dynamo.utils import counters

    class Probe(Hook):
        """Per iteration: wall time, graphs compiled so far, the resident-set peak."""

        def __init__(self) -> None:
            self.records: List[Dict[str, Any]] = []

        def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
            reset_peak_rss()
            self.start = time.perf_counter()

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                             outputs: Any = None) -> None:
            self.records.append(dict(time_s=time.perf_counter() - self.start,
                                     peak=peak_rss_bytes(),
                                     graphs=counters['stats']['unique_graphs']))

    size = SIZES[case['model']]['tiny' if case['quick'] else 'full']
    if case['memory']:  # pay what does not depend on the model's size before the baseline
        with tempfile.TemporaryDirectory() as work_dir:
            make_runner(runner_cfg(case, work_dir, SIZES[case['model']]['tiny'], 1)).train()
        torch._dynamo.reset()  # the measured model compiles afresh
    baseline = rss_bytes()
    with tempfile.TemporaryDirectory() as work_dir:
        runner = make_runner(runner_cfg(case, work_dir, size, case['warmup'] + case['steps']))
        probe = Probe()
        runner.register_hook(probe, priority='VERY_LOW')
        runner.train()
        del runner
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(baseline=baseline, records=probe.records))
    if dist.get_rank():
        return {}
    iters = range(len(probe.records))
    times = [max(g['records'][i]['time_s'] for g in gathered) for i in iters]
    warm, steady = times[:case['warmup']], summary(times[case['warmup']:])
    out = dict(case, world_size=len(gathered), step_s=steady,
               compile_s=sum(warm) - len(warm) * steady['median'],
               graphs=probe.records[-1]['graphs'],
               graph_breaks=dict(counters['graph_break'].most_common(6)))
    if case['memory']:
        out['peak_bytes'] = summary(max(g['records'][i]['peak'] - g['baseline'] for g in gathered)
                                    for i in iters[case['warmup']:])
    return out


def _row(r: Dict[str, Any], cells: List[str]) -> List[str]:
    load = f"{r['load_before']:.1f} → {r['load_after']:.1f}"
    if 'error' in r:
        cells = ['failed: ' + r['error'].replace('|', '/')] + [''] * (len(cells) - 1)
    return [r['model'], r['arm'], *cells, load]


def tables(results: List[Dict[str, Any]]) -> str:
    """The step-time table, the goal's verdict and the memory table."""
    by = {(r['model'], r['arm'], r['memory']): r for r in results}
    times, peaks, verdicts = [], [], []
    for model in SIZES:
        for arm in TIME_ARMS:
            r = by.get((model, arm, False))
            if r:
                times.append(_row(r, [spread(r['step_s'], '{:.3f}'), f"{r['compile_s']:.1f}",
                                      str(r['graphs'])] if 'error' not in r else ['', '', '']))
        for arm in MEMORY_ARMS:
            r = by.get((model, arm, True))
            if r:
                peaks.append(_row(r, [spread(r['peak_bytes'], '{:,.1f}', 1 / records.MIB),
                                      f"{r['step_s']['median']:.3f}"] if 'error' not in r
                                  else ['', '']))
        whole, regional = by.get((model, TIME_ARMS[1], False)), by.get((model, TIME_ARMS[2], False))
        if whole and regional and 'error' not in whole and 'error' not in regional:
            step = regional['step_s']['median'] / whole['step_s']['median']
            comp = regional['compile_s'] / whole['compile_s']
            verdicts.append(f"{model}: regional / whole-step steady step {step:.2f} "
                            f"({'holds' if step <= 1 else '**misses**'} ≤ 1), compile time "
                            f"{comp:.2f} ({'holds' if comp <= 0.5 else '**misses**'} ≤ 0.5)")
    load = 'load (1 min) before → after'
    return '\n\n'.join([
        records.header('python -m benchmarks.compile')
        + f' FSDP2 over {NPROC} ranks (gloo), fp32, AdamW, inductor.',
        records.table(['model', 'arm', 'steady step s, median (min–max)', 'compile s', 'graphs',
                       load], times),
        'Goal: ' + ('; '.join(verdicts) or 'no pair of compile arms ran') + '.',
        records.table(['model', 'arm', 'peak per rank MiB, median (min–max)', 'steady step s',
                       load], peaks)])


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.compile',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--quick', action='store_true', help='tiny models, 2 + 2 iterations')
    parser.add_argument('--only', help='run only the cases whose "model/arm" contains this')
    parser.add_argument('--resume', action='store_true', help='keep the cases already in --out')
    parser.add_argument('--timeout', type=float, default=1800, help='seconds per job')
    records.add_output_options(parser, 'compile')
    args = parser.parse_args(argv)
    results = records.load_results(args.out) if args.resume else []
    done = {(r['model'], r['arm'], r['memory']) for r in results}
    warmup, steps = (2, 2) if args.quick else (3, 6)
    for model in SIZES:
        for memory, arms in ((False, TIME_ARMS), (True, MEMORY_ARMS)):
            for arm in arms:
                name = f'{model}/{arm}' + (' (memory)' if memory else '')
                if (model, arm, memory) in done or (args.only and args.only not in name):
                    continue
                case = dict(model=model, arm=arm, memory=memory, quick=args.quick,
                            warmup=warmup, steps=steps)
                with tempfile.TemporaryDirectory(prefix='mmfsdp-inductor-') as cache:
                    load = load_average()
                    try:
                        results += torchrun('compile', [case], NPROC, args.timeout, memory,
                                            env=dict(TORCHINDUCTOR_CACHE_DIR=cache))
                    except JobFailed as e:  # a failure is a result
                        print(e, file=sys.stderr)
                        results.append(dict(case, error=error_line(e), load_before=load,
                                            load_after=load_average()))
                records.save_results(args.out, results)
    records.finish(args, {'compile': tables(results)})


if __name__ == '__main__':
    main()
