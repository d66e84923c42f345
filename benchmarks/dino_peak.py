"""The small DINO of the zoo tier, planned and measured per rank at N = 2 and 4:
``.venv-zoo/bin/python -m benchmarks.dino_peak`` (needs mmdet 3.3.0, ``tools/zoo_env.sh``).

mmdet's ``dino/dino-5scale_swin-l_8xb2-12e_coco.py`` as shipped (``with_cp=True`` in the
Swin, AdamW, clipping, ``lr_mult=0.1`` on the backbone) with the Swin-L made small as in
``tests/zoo/test_mmdet.py`` (embed 32, depths 1/1/2/1, window 4), 2 encoder and decoder
layers, 100 queries, one class, 2 generated 128 x 128 images per rank; FSDP2 with
``auto_wrap_policy='auto'`` (SwinBlock, PatchMerging, the encoder and decoder layers).
*Planned*: ``python -m mmfsdp.plan --format json --device cpu --cpu-allocator glibc``'s step
peak per rank; *measured*: section 16's method (``benchmarks.auto_wrap.run_case``: the worst
rank's step peak above the resident set before the runner, after a warm-up run, glibc with
the 1 MiB mmap threshold, median of 2 steps). Block: ``dino-small``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from .auto_wrap import env, zoo_missing
from .core import records
from .core.launch import JobFailed, error_line, torchrun
from .core.records import mib

REPO = Path(__file__).resolve().parents[1]
SIZE, IMAGES, BATCH = 128, 8, 2
#: The small DINO of tests/zoo/test_mmdet.py (without its equality settings).
MODEL = dict(num_queries=100,
             backbone=dict(embed_dims=32, depths=[1, 1, 2, 1], num_heads=[1, 2, 4, 8],
                           window_size=4, init_cfg=None),
             neck=dict(in_channels=[32, 64, 128, 256]), encoder=dict(num_layers=2),
             decoder=dict(num_layers=2), bbox_head=dict(num_classes=1),
             test_cfg=dict(max_per_img=100))
COLUMNS = ['N', 'planned step peak per rank (MiB)', 'measured step peak per rank (MiB)',
           'measured / planned']


def write_data(root: Path) -> None:
    """``root/img/*.png`` and ``root/ann.json``: noise with one box each."""
    import numpy as np
    from PIL import Image
    (root / 'img').mkdir()
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        Image.fromarray(rng.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)).save(
            root / 'img' / f'{i}.png')
    (root / 'ann.json').write_text(json.dumps(dict(
        images=[dict(id=i, file_name=f'{i}.png', height=SIZE, width=SIZE)
                for i in range(IMAGES)],
        annotations=[dict(id=i, image_id=i, category_id=1, bbox=[32, 32, 64, 48], area=3072,
                          iscrowd=0) for i in range(IMAGES)],
        categories=[dict(id=1, name='box')])))


def write_config(path: Path, root: Path) -> Path:
    pipeline = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True),
                dict(type='Resize', scale=(SIZE, SIZE), keep_ratio=True),
                dict(type='PackDetInputs')]
    cfg = dict(
        _base_=['mmdet::dino/dino-5scale_swin-l_8xb2-12e_coco.py'], model=MODEL,
        train_dataloader=dict(batch_size=BATCH, num_workers=0, persistent_workers=False,
                              dataset=dict(data_root=f'{root}/', ann_file='ann.json',
                                           data_prefix=dict(img='img/'), pipeline=pipeline,
                                           metainfo=dict(classes=('box', )),
                                           filter_cfg=dict(filter_empty_gt=False))),
        runner_type='mmfsdp.FSDPRunner',
        model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard', auto_wrap_policy='auto'),
        custom_imports=dict(imports=['mmfsdp'], allow_failed_imports=False))
    path.write_text(''.join(f'{k} = {v!r}\n' for k, v in cfg.items()))
    return path


def plan(config: Path, sizes: List[int]) -> List[Dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, '-m', 'mmfsdp.plan', str(config), '--world-size', *map(str, sizes),
         '--format', 'json', '--device', 'cpu', '--cpu-allocator', 'glibc'],
        check=True, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, **env()))
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--world-sizes', nargs='+', type=int, default=[2, 4])
    records.add_output_options(parser, 'dino_peak')
    args = parser.parse_args()
    prog = f'{os.path.relpath(sys.executable, REPO)} -m benchmarks.dino_peak'
    missing = zoo_missing()
    if missing:
        print(f'skipped: {missing}')
        return
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        write_data(Path(tmp))
        config = write_config(Path(tmp) / 'dino_small.py', Path(tmp))
        plans = plan(config, args.world_sizes)
        for n, planned in zip(args.world_sizes, plans):
            case = dict(world_size=n, planned_bytes=planned['step']['peak_bytes'])
            try:
                case.update(torchrun('auto_wrap', [dict(config=str(config))], n,
                                     env=env())[0])
            except JobFailed as e:
                case['error'] = error_line(e)
            results.append(case)
            records.save_results(args.out, results)
            measured = case.get('peak_bytes', {}).get('median')
            rows.append([n, mib(case['planned_bytes']), mib(measured) if measured else
                         case.get('error'), f'{measured / case["planned_bytes"]:.3f}'
                         if measured else '—'])
    records.finish(args, {'dino-small': records.header(prog) + '\n\n'
                          + records.table(COLUMNS, rows)})


if __name__ == '__main__':
    main()
