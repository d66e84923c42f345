"""``python -m mmfsdp.plan`` on mmdet's shipped RetinaNet (ResNet-18 + FPN) before any launch.

The config inherits mmdet 3.3.0's ``retinanet/retinanet_r18_fpn_1x_coco.py`` as shipped
(``frozen_stages=1``, ``norm_eval=True``, SGD) and points it at a few generated COCO-format
images, with a multi-scale ``RandomChoiceResize`` train pipeline as mmdet's ``ms`` configs
have (small scales, so that the head's loss computes quickly on the CPU), a single-class
head and no pretrained download. The plan must trace the step although the backbone's stem and
first stage are frozen, run the head's loss (whose anchor assignment reads tensor values) on
real tensors and say so, plan the pipeline's largest scale and say which, and answer
``--fit-memory``.

Needs the environment of ``tools/zoo_env.sh`` (mmdet imports ``mmcv.ops``); skipped, with the
reason, otherwise. Marked ``zoo``: select it with ``-m zoo``.
"""
import json
import sys

import pytest
from zoo_jobs import JOB_TIMEOUT_S, run_tool, write_config

from harness import REPO, job_env, run_job

pytestmark = pytest.mark.zoo

try:
    import mmdet.models  # noqa: F401  (imports mmcv.ops: fails without the compiled ops)
except Exception as e:
    pytest.skip(f'mmdet cannot be imported here (tools/zoo_env.sh builds an env where it can): '
                f'{type(e).__name__}: {e}', allow_module_level=True)

SCALES = [(320, 192), (320, 224), (320, 256)]


@pytest.fixture(scope='module')
def config(tmp_path_factory):
    import numpy as np
    from PIL import Image
    root = tmp_path_factory.mktemp('coco')
    (root / 'img').mkdir()
    images, annotations = [], []
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(
            root / 'img' / f'{i}.png')
        images.append(dict(id=i, file_name=f'{i}.png', height=60, width=80))
        annotations.append(dict(id=i, image_id=i, category_id=1, bbox=[10, 10, 30, 20],
                                area=600, iscrowd=0))
    (root / 'ann.json').write_text(json.dumps(dict(
        images=images, annotations=annotations, categories=[dict(id=1, name='square')])))
    pipeline = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True),
                dict(type='RandomChoiceResize', scales=SCALES, keep_ratio=True),
                dict(type='RandomFlip', prob=0.5), dict(type='PackDetInputs')]
    cfg = dict(
        _base_=['mmdet::retinanet/retinanet_r18_fpn_1x_coco.py'],
        model=dict(backbone=dict(init_cfg=None), bbox_head=dict(num_classes=1)),
        train_dataloader=dict(batch_size=2, num_workers=0, persistent_workers=False, dataset=dict(
            data_root=f'{root}/', ann_file='ann.json', data_prefix=dict(img='img/'),
            metainfo=dict(classes=('square', )), pipeline=pipeline,
            filter_cfg=dict(filter_empty_gt=False, min_size=0))),
        model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=dict(
            type='transformer', layer_cls=['BasicBlock'])),
        custom_imports=dict(imports=['mmfsdp'], allow_failed_imports=False))
    return write_config(tmp_path_factory, ''.join(f'{k} = {v!r}\n' for k, v in cfg.items()))


def test_the_plan_traces_a_retinanet_with_a_frozen_stage_at_its_largest_scale(config):
    plans = json.loads(run_job([sys.executable, '-m', 'mmfsdp.plan', str(config), '--world-size',
                                '1', '2', '--format', 'json'], env=job_env(REPO),
                               timeout=JOB_TIMEOUT_S, merge_stderr=False))
    for plan in plans:
        units = {u['name']: u for u in plan['units']}
        # frozen_stages=1: layer1 is held and gathered, never given a gradient or SGD momentum
        for name in ('backbone.layer1.0', 'backbone.layer1.1'):
            assert units[name]['param_bytes'] > 0
            assert units[name]['grad_bytes'] == units[name]['optimizer_bytes'] == 0
        step = plan['step']
        assert step is not None and step['activation_bytes'] > 0
        (part, ) = step['real_parts']  # the anchor assignment reads values: measured, said so
        assert part.startswith('bbox_head.loss (DataDependentOutputException'), part
        assert step['batch'] == ('one sample of train_dataloader.dataset at the pipeline\'s '
                                 'largest scale (RandomChoiceResize -> Resize 320x256), repeated')


def test_fit_memory_answers_for_the_retinanet(config):
    out = run_tool([sys.executable, '-m', 'mmfsdp.plan', str(config), '--world-size', '1', '2',
                    '--fit-memory', '8GiB'])
    assert 'smallest that fits: 1 ranks, DDP' in out, out
