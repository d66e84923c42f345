"""``auto_wrap_policy='auto'`` against hand-written class lists, planned and measured:
``python -m benchmarks.auto_wrap`` (the zoo backbones need the zoo environment:
``.venv-zoo/bin/python -m benchmarks.auto_wrap``; elsewhere they are skipped, said so).

For each model, FSDP2 (AdamW, N = 2) runs under the policy ``'auto'`` and under each
hand-written ``transformer`` class list, from one config file per model and policy:
``python -m mmfsdp.plan --format json --device cpu --cpu-allocator glibc`` plans it
(the planned step peak per rank) and a torchrun job of 2 CPU processes trains it
(the measured step peak per rank: the worst rank's resident-set high-water mark of a
step above the resident set before the runner was built, after one warm-up run of
the same config; glibc with the 1 MiB mmap threshold; median of 2 steps). The table
gives both peaks of ``'auto'`` and of the best list (the lowest measured peak), and
``'auto'``'s largest unit (the root included) over the largest block (the largest unit
of the block-class list). Models: the demo GPT (``configs/gpt-nano_fsdp2_2xcpu.py``,
its stdlib batch), the ResNet and ViT of ``tests/support/vision.py`` and small
versions of the zoo tier's backbones (mmpretrain ResNet-18 and ViT, mmseg FCN's
ResNetV1c-50, mmdet RetinaNet's ResNet-18 and DINO's Swin) on 4 x 3 x 64 x 64 images
per rank. Block: ``auto-wrap``.
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch.utils.data import Dataset

from .core import records
from .core.launch import JobFailed, error_line, torchrun
from .core.records import mib

REPO = Path(__file__).resolve().parents[1]
N = 2
GOAL = 0.10
IMAGES = """custom_imports = dict(imports=['vision', 'benchmarks.auto_wrap'])
train_dataloader = dict(batch_size=4, num_workers=0, dataset=dict(type='AutoWrapImages'),
                        sampler=dict(type='DefaultSampler', shuffle=False),
                        collate_fn=dict(type='pseudo_collate'))
preprocessor = dict(type='ImgDataPreprocessor', mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4])
"""


def zoo(scope: str, backbone: str) -> str:
    """A config of ``ZooBackbone``: ``backbone`` built from ``scope``'s registry."""
    return IMAGES + f"model = dict(type='ZooBackbone', scope='{scope}', backbone={backbone}, " \
        "data_preprocessor=preprocessor)\n"


#: name -> (the config file or lines, the hand-written class lists: the block class first)
CASES: Dict[str, Any] = {
    'demo GPT (gpt-nano)': (REPO / 'configs' / 'gpt-nano_fsdp2_2xcpu.py',
                            [['TransformerBlock'], ['TransformerBlock', 'Embedding']]),
    'BottleneckResNet': (IMAGES + "model = dict(type='BottleneckResNet', width=16, "
                         "data_preprocessor=preprocessor)\n", [['Bottleneck'], ['ResLayer']]),
    'TinyViT': (IMAGES + "model = dict(type='TinyViT', dim=256, depth=6, size=64, "
                "data_preprocessor=preprocessor)\n",
                [['EncoderLayer'], ['EncoderLayer', 'Attention']]),
    'mmpretrain ResNet-18': (zoo('mmpretrain', "dict(type='ResNet', depth=18, stem_channels=32, "
                                 "base_channels=32)"), [['BasicBlock'], ['ResLayer']]),
    'mmpretrain ViT': (zoo('mmpretrain', "dict(type='VisionTransformer', img_size=64, "
                           "patch_size=8, arch=dict(embed_dims=256, num_layers=6, num_heads=4, "
                           "feedforward_channels=1024))"),
                       [['TransformerEncoderLayer'],
                        ['TransformerEncoderLayer', 'MultiheadAttention']]),
    'mmseg FCN ResNetV1c-50': (zoo('mmseg', "dict(type='ResNetV1c', depth=50, stem_channels=32, "
                                   "base_channels=32, strides=(1, 2, 1, 1), "
                                   "dilations=(1, 1, 2, 4), contract_dilation=True)"),
                               [['Bottleneck'], ['ResLayer']]),
    'mmdet RetinaNet ResNet-18': (zoo('mmdet', "dict(type='ResNet', depth=18, base_channels=32,"
                                      " out_indices=(1, 2, 3))"), [['BasicBlock'], ['ResLayer']]),
    'mmdet DINO Swin': (zoo('mmdet', "dict(type='SwinTransformer', pretrain_img_size=64, "
                            "embed_dims=64, depths=(2, 2, 6, 2), num_heads=(2, 4, 8, 16), "
                            "window_size=4, out_indices=(1, 2, 3))"),
                        [['SwinBlock'], ['SwinBlock', 'PatchMerging'], ['SwinBlockSequence']]),
}
COLUMNS = ['model', "'auto' units", "'auto' planned / measured MiB", 'best hand list',
           'its planned / measured MiB', 'auto / hand planned', 'auto / hand measured',
           'same units', 'largest unit / largest block']


@DATASETS.register_module(force=True)
class AutoWrapImages(Dataset):
    """Eight constant uint8 images of 64 x 64 with labels 0-3."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return dict(inputs=torch.full((3, 64, 64), i, dtype=torch.uint8), data_samples=i % 4)


@MODELS.register_module(force=True)
class ZooBackbone(BaseModel):
    """An OpenMMLab backbone trained alone: the loss is the mean square of its outputs."""

    def __init__(self, scope: str, backbone: Dict[str, Any], data_preprocessor: Any = None):
        super().__init__(data_preprocessor=data_preprocessor)
        importlib.import_module(f'{scope}.models')
        self.backbone = MODELS.build(dict(backbone, _scope_=scope))

    def forward(self, inputs: torch.Tensor, data_samples: Any = None, mode: str = 'tensor'):
        outs = self.backbone(inputs)
        outs = [o for out in outs for o in (out if isinstance(out, (list, tuple)) else [out])]
        if mode == 'loss':
            return dict(loss=sum(o.float().pow(2).mean() for o in outs))
        return outs


def write_config(path: Path, config: Any, policy: Any) -> Path:
    """``config`` under ``policy`` (``'auto'`` or a class list) written to ``path``."""
    policy = repr(policy) if policy == 'auto' else f"dict(type='transformer', layer_cls={policy})"
    inherits = isinstance(config, Path)  # then _delete_ replaces the parent's dicts
    delete = '_delete_=True, ' if inherits else ''
    path.write_text((f"_base_ = ['{config}']\n" if inherits else config)
                    + f"runner_type = 'mmfsdp.FSDPRunner'\nmodel_wrapper_cfg = dict({delete}"
                    f"type='mmfsdp.MMFullyShard', auto_wrap_policy={policy})\noptim_wrapper = "
                    f"dict({delete}optimizer=dict(type='AdamW', lr=1e-3))\n")
    return path


def env() -> Dict[str, str]:
    """``PYTHONPATH`` with ``tests/support`` (the vision models) and the repository."""
    paths = [str(REPO / 'tests' / 'support'), str(REPO), os.environ.get('PYTHONPATH', '')]
    return dict(PYTHONPATH=os.pathsep.join(p for p in paths if p))


def plan(config: Path) -> Dict[str, Any]:
    """The JSON plan of ``config`` at N ranks, for the CPU run the job measures."""
    out = subprocess.run(
        [sys.executable, '-m', 'mmfsdp.plan', str(config), '--world-size', str(N), '--format',
         'json', '--device', 'cpu', '--cpu-allocator', 'glibc'],
        check=True, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, **env()))
    return json.loads(out.stdout)[0]


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: the worst rank's step peaks (above the RSS before the runner)."""
    import gc

    import torch.distributed as dist
    from mmengine.config import Config

    from .core.measure import CollectiveCounter, rss_bytes, summary
    from .core.workload import make_runner
    from .memory import step_probe

    def runner(work_dir: str, iters: int) -> Any:
        cfg = Config.fromfile(case['config'])
        cfg.merge_from_dict(dict(
            work_dir=work_dir, launcher='pytorch', log_level='WARNING', randomness=dict(seed=0),
            env_cfg=dict(dist_cfg=dict(timeout=900)), val_dataloader=None, val_cfg=None,
            val_evaluator=None, param_scheduler=None,
            default_hooks=dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1000))))
        cfg.train_cfg = dict(by_epoch=False, max_iters=iters)
        return make_runner(cfg)

    counter = CollectiveCounter()
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir, counter:
        warm = runner(work_dir, 1)  # imports, scaffolding, gloo buffers: paid before the baseline
        warm.train()
        del warm
        gc.collect()
        baseline = rss_bytes()
        run = runner(work_dir, 3)
        probe = step_probe(counter)
        run.register_hook(probe, priority='VERY_LOW')
        run.train()
        del run
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [r['peak_bytes'] - baseline for r in probe.records[1:]])
    return dict(case, peak_bytes=summary(max(steps) for steps in zip(*gathered)))


def zoo_missing() -> Optional[str]:
    """Why the zoo backbones cannot be built here, or None."""
    try:
        for scope in ('mmpretrain', 'mmseg', 'mmdet'):
            importlib.import_module(f'{scope}.models')
    except ImportError as e:
        return f'{e} (run it with the zoo environment, .venv-zoo/bin/python)'
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=list(CASES), choices=list(CASES))
    parser.add_argument('--resume', action='store_true', help='keep the models done in --out')
    parser.add_argument('--retable', action='store_true',
                        help='only rebuild the table from the cases in --out')
    records.add_output_options(parser, 'auto_wrap')
    args = parser.parse_args()
    missing = zoo_missing()

    def done(name: str) -> bool:  # 'auto' and every list planned and measured
        cases = [c for c in results if c['name'] == name and 'error' not in c]
        return len(cases) == 1 + len(CASES[name][1])
    results = records.load_results(args.out) if args.retable or args.resume else []
    results, skipped = [c for c in results if 'error' not in c], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in [] if args.retable else [m for m in args.models if not done(m)]:
            config, lists = CASES[name]
            if missing and 'ZooBackbone' in str(config):
                print(f'skipped {name}: {missing}', flush=True)
                skipped.append(name)
                continue
            for policy in ['auto', *lists]:
                path = write_config(Path(tmp) / f'case{len(results)}.py', config, policy)
                case = dict(name=name, policy='+'.join(policy) if policy != 'auto' else 'auto',
                            config=str(path))
                try:
                    case['plan'] = plan(path)
                    case.update(torchrun('auto_wrap', [case], N, env=env())[0])
                except subprocess.CalledProcessError as e:
                    case['error'] = e.stderr.strip().splitlines()[-1]
                    print(f'{name} / {case["policy"]}: {e.stderr}', flush=True)
                except JobFailed as e:
                    case['error'] = error_line(e)
                    print(f'{name} / {case["policy"]}: {e}', flush=True)
                results.append(case)
                records.save_results(args.out, results)
    rows = [row(name, {c['policy']: c for c in results if c['name'] == name}, CASES[name][1])
            for name in CASES if done(name)]
    prog = f'{os.path.relpath(sys.executable, REPO)} -m benchmarks.auto_wrap'
    text = records.header(prog) + '\n\n' + records.table(COLUMNS, rows)
    for c in results:
        if 'error' in c:
            text += f"\n\nFailed: {c['name']} under {c['policy']}: {c['error']}"
    if skipped:
        text += f"\n\nSkipped: {', '.join(skipped)} ({missing})."
    records.finish(args, {'auto-wrap': text})


def row(name: str, cases: Dict[str, Dict[str, Any]], lists: List[List[str]]) -> List[str]:
    """One table row: 'auto' and the hand list of the lowest measured (else planned) peak."""
    def peaks(c: Dict[str, Any]) -> tuple:
        measured = c['peak_bytes']['median'] if 'peak_bytes' in c else float('nan')
        return c['plan']['step']['peak_bytes'], measured

    def cell(b: float) -> str:
        return mib(b) if b == b else 'failed'

    def ratio(a: float, b: float) -> str:
        r = a / b
        return f'{r:.3f}' + ('' if r <= 1 + GOAL else ' **(> 1.10)**') if r == r else 'failed'

    auto, hands = cases['auto'], [cases['+'.join(cls)] for cls in lists]
    best = min(hands, key=lambda c: (peaks(c)[1] != peaks(c)[1], peaks(c)[1], peaks(c)[0]))
    units = auto['plan']['units']
    blocks = [u['numel'] for u in hands[0]['plan']['units'] if u['name'] != '(root)']
    inner = [u for u in units if u['name'] != '(root)']
    classes = sorted({u['cls'] for u in inner})
    (ap, am), (hp, hm) = peaks(auto), peaks(best)
    same = {u['name'] for u in units} == {u['name'] for u in best['plan']['units']}
    return [name, f"{len(inner)} x {'+'.join(classes)}", f'{mib(ap)} / {cell(am)}',
            best['policy'], f'{mib(hp)} / {cell(hm)}', ratio(ap, hp), ratio(am, hm),
            'yes' if same else 'no', f"{max(u['numel'] for u in units) / max(blocks):.2f}"]


if __name__ == '__main__':
    main()
