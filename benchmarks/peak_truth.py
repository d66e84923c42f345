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

The zoo models (``--models retinanet-r18 fcn-r18``; run with the zoo environment,
``.venv-zoo/bin/python``) are mmdet 3.3.0's shipped ``retinanet_r18_fpn_1x_coco.py`` and
mmseg 1.2.2's ``fcn_r18-d8_4xb2-80k_cityscapes-512x1024.py`` on generated images (RetinaNet
320 x 256, FCN 256 x 256; ``work_dirs/benchmarks/zoo_data``), ``BasicBlock`` units and
checkpointed layers, the shipped SGD: trained from their config file as
:mod:`benchmarks.auto_wrap` trains one (after a warm-up run of the same config) and
predicted by ``python -m mmfsdp.plan CONFIG --device cpu --cpu-allocator glibc``.
Block: ``peak-truth-zoo``. ``--dino`` plans mmdet's DINO Swin-L at 8 ranks on an
accelerator (how its large-model example trains it: AMP bf16 and checkpointing; no
measurement), at the pipeline's largest scale and at 667 x 400, where fp32 too. Block:
``dino-swin-l``.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .core import records
from .core.launch import MMAP_THRESHOLD, REPO, preload_for, torchrun
from .core.workload import CHECKPOINT_BLOCKS, STRATEGIES, build_model, runner_cfg
from .memory import measure_steps

GOAL = 0.10
STRATEGY_NAMES = ['DDP', 'FSDP1 FULL_SHARD', 'FSDP2 reshard']
ZOO_DATA = Path(REPO) / 'work_dirs' / 'benchmarks' / 'zoo_data'
BLOCKS = dict(type='transformer', layer_cls=['BasicBlock'])
#: model -> its config: mmdet's and mmseg's shipped files, changed only for the generated data
ZOO: Dict[str, Dict[str, Any]] = {
    'retinanet-r18': dict(
        _base_=['mmdet::retinanet/retinanet_r18_fpn_1x_coco.py'],
        model=dict(backbone=dict(init_cfg=None), bbox_head=dict(num_classes=1)),
        train_dataloader=dict(num_workers=0, persistent_workers=False, dataset=dict(
            data_root=f'{ZOO_DATA}/det/', ann_file='ann.json', data_prefix=dict(img='img/'),
            metainfo=dict(classes=('square', )), filter_cfg=dict(filter_empty_gt=False),
            pipeline=[dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True),
                      dict(type='Resize', scale=(320, 256), keep_ratio=True),
                      dict(type='PackDetInputs')]))),
    'fcn-r18': dict(
        _base_=['mmseg::fcn/fcn_r18-d8_4xb2-80k_cityscapes-512x1024.py'],
        data_preprocessor=dict(size=(256, 256)),
        model=dict(data_preprocessor=dict(size=(256, 256)), pretrained=None,
                   decode_head=dict(num_classes=2), auxiliary_head=dict(num_classes=2)),
        train_dataloader=dict(num_workers=0, persistent_workers=False, dataset=dict(
            _delete_=True, type='BaseSegDataset', data_root=f'{ZOO_DATA}/seg',
            data_prefix=dict(img_path='img', seg_map_path='ann'), img_suffix='.png',
            seg_map_suffix='.png', metainfo=dict(classes=('background', 'square')),
            pipeline=[dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
                      dict(type='PackSegInputs')]))),
}


#: mmdet's DINO Swin-L as its projects/example_largemodel trains it with FSDP: the Swin blocks and
#: deformable encoder layers are the units and are checkpointed (no with_cp: mmfsdp checkpoints)
DINO_LAYERS = ['SwinBlock', 'DeformableDetrTransformerEncoderLayer']
DINO = dict(
    _base_=['mmdet::dino/dino-5scale_swin-l_8xb2-12e_coco.py'],
    model=dict(backbone=dict(init_cfg=None, with_cp=False)),
    train_dataloader=dict(num_workers=0, persistent_workers=False, dataset=dict(
        data_root=f'{ZOO_DATA}/det/', ann_file='ann.json', data_prefix=dict(img='img/'),
        metainfo=dict(classes=('square', )))),
    runner_type='mmfsdp.FSDPRunner', custom_imports=dict(imports=['mmfsdp']),
    model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=dict(
        type='transformer', layer_cls=DINO_LAYERS), activation_checkpointing=dict(
            layer_cls=DINO_LAYERS)))
#: projects/example_largemodel/README.md (mmdet 3.x), peak GB per GPU at 8 x 2 images
DINO_README = ('FSDP + AMP + checkpointing of backbone and encoder 8.5 GB (2.4 s/iter), the same '
               'without AMP 14 GB (2.9 s/iter), DeepSpeed ZeRO-3 + AMP + both 5.0 GB (1.4 s/iter)')


def dino_plan(scale: Optional[Tuple[int, int]] = None, world_size: int = 8,
              amp: Optional[str] = 'bfloat16') -> str:
    """The plan of DINO Swin-L at ``world_size`` ranks on an accelerator, and how long it took.

    ``scale``: images resized to it (keep-ratio) instead of the pipeline's largest scale;
    ``amp``: the dtype of mmengine's ``AmpOptimWrapper`` (the README's AMP), ``None``: fp32.
    """
    import time
    zoo_data()
    cfg = dict(DINO, optim_wrapper=dict(type='AmpOptimWrapper', dtype=amp)) if amp else dict(DINO)
    if scale:
        cfg['train_dataloader'] = dict(cfg['train_dataloader'], dataset=dict(
            cfg['train_dataloader']['dataset'], pipeline=ZOO['retinanet-r18'][
                'train_dataloader']['dataset']['pipeline'][:2] + [
                dict(type='Resize', scale=scale, keep_ratio=True), dict(type='PackDetInputs')]))
    path = ZOO_DATA / 'dino-5scale_swin-l.py'
    path.write_text(''.join(f'{k} = {v!r}\n' for k, v in cfg.items()))
    start = time.perf_counter()
    out = subprocess.run([sys.executable, '-m', 'mmfsdp.plan', str(path), '--world-size',
                          str(world_size), '--format', 'json', '--device', 'cuda'],
                         check=True, capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=REPO))
    took, plan = time.perf_counter() - start, json.loads(out.stdout)[0]
    step, gib = plan['step'], lambda b: f'{b / 2**30:.2f} GiB'
    head = (f"mmdet 3.3.0's `dino/dino-5scale_swin-l_8xb2-12e_coco.py` "
            f"({plan['numel'] / 1e6:.0f} M parameters), FSDP2 at {world_size} ranks, "
            'AdamW as shipped, ' + (f"AMP {amp} (mmengine's AmpOptimWrapper: fp32 parameters, "
                                    'the forward under autocast), ' if amp else 'fp32, ') +
            f"{' and '.join(DINO_LAYERS)} as units and checkpointed, batch 2 per rank, "
            f'planned for an accelerator in {took:.0f} s on this host: model states '
            f"{gib(plan['model_state_bytes_per_rank'])} per rank, ")
    if step is None:
        return head + f"the step not traced: {plan['step_error']}"
    return head + (f"step peak **{gib(step['peak_bytes'])}** per rank (gathered "
                   f"{gib(step['gathered_bytes'])}, activations {gib(step['activation_bytes'])}, "
                   f"transient {gib(step['transient_bytes'])}; batch: {step['batch']}; on real "
                   f"tensors: {'; '.join(step['real_parts'])}). mmdet's README: {DINO_README}.")


def zoo_data() -> None:
    """Four images with a bright square each: COCO boxes (80 x 64) and label maps (256 x 256)."""
    import numpy as np
    from PIL import Image
    if (ZOO_DATA / 'det' / 'ann.json').exists():
        return
    rng = np.random.default_rng(0)
    images, boxes = [], []
    for kind, (w, h) in (('det', (80, 64)), ('seg', (256, 256))):
        for sub in ('img', 'ann'):
            (ZOO_DATA / kind / sub).mkdir(parents=True, exist_ok=True)
        for i in range(4):
            mask = np.zeros((h, w), np.uint8)
            mask[h // 4:h // 4 + h // 2, w // 8 * i:w // 8 * i + w // 2] = 1
            pixels = 64 + 128 * mask[..., None] + rng.integers(0, 40, (h, w, 3))
            Image.fromarray(pixels.astype(np.uint8)).save(ZOO_DATA / kind / 'img' / f'{i}.png')
            if kind == 'seg':
                Image.fromarray(mask).save(ZOO_DATA / kind / 'ann' / f'{i}.png')
                continue
            images.append(dict(id=i, file_name=f'{i}.png', height=h, width=w))
            boxes.append(dict(id=i, image_id=i, category_id=1, iscrowd=0, area=h * w / 4,
                              bbox=[w // 8 * i, h // 4, w // 2, h // 2]))
    (ZOO_DATA / 'det' / 'ann.json').write_text(json.dumps(dict(
        images=images, annotations=boxes, categories=[dict(id=1, name='square')])))


def zoo_config(case: Dict[str, Any]) -> str:
    """The case's config file (written next to the generated data)."""
    zoo_data()
    cfg = dict(ZOO[case['model']], runner_type='mmfsdp.FSDPRunner',
               model_wrapper_cfg=wrapper_cfg_of(case),
               custom_imports=dict(imports=['mmfsdp'], allow_failed_imports=False))
    cfg['train_dataloader'] = dict(cfg['train_dataloader'], batch_size=case['batch_size'])
    path = ZOO_DATA / f"{case['name'].replace('/', '_').replace(' ', '-')}.py"
    path.write_text(''.join(f'{k} = {v!r}\n' for k, v in cfg.items()))
    return str(path)


def wrapper_cfg_of(case: Dict[str, Any]) -> Dict[str, Any]:
    """The case's ``model_wrapper_cfg``."""
    cfg = dict(STRATEGIES[case['strategy']].wrapper_cfg)
    zoo = case['model'] in ZOO
    if zoo and case['strategy'] != 'DDP':
        cfg['auto_wrap_policy'] = BLOCKS
    if case['ac']:
        cfg['activation_checkpointing'] = dict(layer_cls=BLOCKS['layer_cls']) if zoo \
            else CHECKPOINT_BLOCKS
    return cfg


def predict(case: Dict[str, Any]) -> Dict[str, Any]:
    """The plan's step peak for a case (model on the meta device, batch from the config)."""
    from mmfsdp.plan import heap_threshold, plan_for, step_peak, trace_for
    from mmfsdp.plan.batch import config_batch
    from mmfsdp.registry import MODEL_WRAPPERS
    if case['model'] in ZOO:  # as a user plans it
        out = subprocess.run(
            [sys.executable, '-m', 'mmfsdp.plan', zoo_config(case), '--world-size',
             str(case['world_size']), '--format', 'json', '--device', 'cpu', '--cpu-allocator',
             case.get('cpu_allocator', 'glibc')], check=True, capture_output=True, text=True,
            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO, **{
                k: v for k, v in launch_env(case).items() if k.startswith('MALLOC')}))
        return json.loads(out.stdout)[0]['step']
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


def launch_env(case: Dict[str, Any]) -> Dict[str, str]:
    """The malloc variables the case's job runs under (glibc: the 1 MiB mmap threshold)."""
    allocator = case.get('cpu_allocator', 'glibc')
    return (dict(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD)) if allocator == 'glibc'
            else preload_for(allocator))


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: measure a case, then predict it."""
    if case['model'] in ZOO:  # the parent predicts it
        from .auto_wrap import run_case as train_config
        return train_config(case)
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
    parser.add_argument('--models', nargs='*', default=['gpt-25m', 'gpt-100m'])
    parser.add_argument('--world-sizes', nargs='+', type=int, default=[1, 2, 4])
    parser.add_argument('--batch-sizes', nargs='+', type=int, default=[2, 8])
    parser.add_argument('--strategies', nargs='+', default=STRATEGY_NAMES,
                        choices=STRATEGY_NAMES)
    parser.add_argument('--cpu-allocator', default='glibc',
                        choices=['glibc', 'jemalloc', 'tcmalloc'])
    parser.add_argument('--resume', action='store_true', help='keep the cases already in --out')
    parser.add_argument('--repredict', action='store_true',
                        help='only recompute the predictions of the cases in --out')
    parser.add_argument('--dino', action='store_true', help="also plan mmdet's DINO Swin-L at 8 "
                        'ranks (zoo environment; no measurement)')
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
                if case['model'] in ZOO:
                    case = dict(case, config=zoo_config(case))
                results += [dict(r, predicted=r.get('predicted') or predict(r)) for r in torchrun(
                    'peak_truth', [case], case['world_size'], memory=glibc, env=env)]
                records.save_results(args.out, results)
    records.save_results(args.out, results)
    prog = f'{os.path.relpath(sys.executable, REPO)} -m benchmarks.peak_truth'
    rows = {'peak-truth': [r for r in results if r['model'] not in ZOO],
            'peak-truth-zoo': [r for r in results if r['model'] in ZOO]}
    blocks = {name: records.header(prog) + '\n\n' + table(r) for name, r in rows.items() if r}
    if args.dino:
        blocks.update({'dino-swin-l': records.header(prog) + ''.join(
            f'\n\n- {dino_plan(scale, amp=amp)}' for scale, amp in (
                (None, 'bfloat16'), ((667, 400), 'bfloat16'), ((667, 400), None)))})
    records.finish(args, blocks)


if __name__ == '__main__':
    main()
