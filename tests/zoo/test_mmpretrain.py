"""mmpretrain's own ``tools/train.py`` and ``tools/test.py`` under mmfsdp's three wrappers.

A real third-party model zoo, run the way its users run it: a small
``VisionTransformer`` and a ResNet-18 ``ImageClassifier`` over generated PNGs
(``CustomDataset``), with ``EMAHook`` and ``Accuracy``. The config is
mmpretrain's own; mmfsdp adds only ``runner_type``, ``model_wrapper_cfg``,
``custom_imports`` and the backend. Each 2-rank job (torchrun) is compared with
mmpretrain's stock one-process run of the same global batch: final weights
(EMA swapped in, as the stock hook saves them) within 2e-5, and the test
accuracy equal. The ViT trains with SGD and the ResNet with AdamW (see
``MODELS``); both land about 1e-7 from one process.

The stock runs set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (mmengine 0.10.7's
test.py cannot read its own checkpoint otherwise on torch >= 2.6); mmfsdp's jobs
run without it. Configs are written outside the work dirs, where the Runner
dumps its own copy under the same name.

BatchNorm: with per-rank batches each rank normalises by its own batch
statistics, so a ResNet trained in training-mode BN differs from one process
by more than rounding. The ResNet runs here use ``norm_eval=True`` (BN in eval
mode, fixed statistics), where the difference vanishes; ``sync_bn='torch'``
removes it too on GPUs (torch's SyncBatchNorm has no CPU kernel).

mmpretrain's shipped ``FlexibleRunner`` configs (ViT-L FSDP, and DeepSpeed as shipped and at
ZeRO-3) run through the same ``tools/train.py`` made small with ``--cfg-options``, only
``runner_type`` changed: they shard (the plan log names ``mmfsdp.MMFullyShard``) and equal the same
run written in mmfsdp's own keys.

A Python-style config (``with read_base(): from .._base_.vit_tiny import *``, classes imported
and given as ``type``, ``runner_type = FSDPRunner``, ``model_wrapper_cfg=dict(type=MMFullyShard,
...layer_cls=[TransformerEncoderLayer])``) trains through the same ``tools/train.py`` and equals
the stock one-process run of the classic config.

Needs mmpretrain 1.2.0 (with mmcv-lite 2.2.0 or mmcv 2.1.0) and a torchvision
that imports beside the installed torch: ``tools/zoo_env.sh`` builds that env and
runs the tier; skipped, with the reason, elsewhere. Marked ``zoo``: excluded
from the default run, select it with ``-m zoo``.
"""
import re
import sys
from pathlib import Path
from typing import List

import pytest
import torch
from zoo_jobs import checkpoint_weights, run_tool, torchrun, write_config

pytestmark = pytest.mark.zoo


def _import_zoo():
    try:
        import mmpretrain
        import torchvision  # noqa: F401
    except Exception as e:  # torchvision built for another torch fails with RuntimeError too
        pytest.skip(f'mmpretrain / torchvision cannot be imported here: {type(e).__name__}: {e}',
                    allow_module_level=True)
    tools = Path(mmpretrain.__file__).parent / '.mim' / 'tools'
    if not (tools / 'train.py').exists():
        pytest.skip(f'mmpretrain is installed without its tools ({tools}/train.py); install '
                    'the wheel from PyPI or a source checkout with `pip install .`',
                    allow_module_level=True)
    return tools


TOOLS = _import_zoo()
TOL = 2e-5
IMAGES_PER_CLASS, SIZE, GLOBAL_BATCH = 16, 32, 8
TOP1 = re.compile(r'accuracy/top1: ([0-9.]+)')

VIT = dict(
    type='ImageClassifier',
    backbone=dict(type='VisionTransformer', img_size=SIZE, patch_size=8,
                  arch=dict(embed_dims=64, num_layers=2, num_heads=2, feedforward_channels=128)),
    neck=None,
    head=dict(type='VisionTransformerClsHead', num_classes=2, in_channels=64,
              loss=dict(type='CrossEntropyLoss', loss_weight=1.0)))
RESNET = dict(
    type='ImageClassifier',
    backbone=dict(type='ResNet', depth=18, num_stages=4, out_indices=(3, ), style='pytorch',
                  norm_eval=True),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(type='LinearClsHead', num_classes=2, in_channels=512,
              loss=dict(type='CrossEntropyLoss', loss_weight=1.0), topk=(1, )))
# The ViT trains with SGD: under AdamW its weights came out 1.4e-5 from one process (within
# 2e-5, the same for all three wrappers) because Adam's update divides by sqrt(v), which turns
# rounding-level gradient differences in near-zero gradients into steps of up to lr. SGD moves a
# weight by lr times its gradient, so the comparison measures the wrappers, not that
# amplification. The ResNet (BN frozen, larger gradients) keeps AdamW: 1.2e-7 there.
SGD = dict(type='SGD', lr=0.05, momentum=0.9, weight_decay=0.0)
ADAMW = dict(type='AdamW', lr=1e-3, weight_decay=0.0)
MODELS = dict(vit=(VIT, ['TransformerEncoderLayer'], SGD),
              resnet18=(RESNET, ['BasicBlock'], ADAMW))
WRAPPERS = dict(
    fsdp1='mmfsdp.MMFullyShardedDataParallel', fsdp2='mmfsdp.MMFullyShard',
    ddp='mmfsdp.MMDistributedDataParallel')


def _write_pngs(root: Path) -> None:
    """Two classes told apart by brightness, with noise: ``root/{train,test}/{dark,bright}``."""
    from PIL import Image
    gen = torch.Generator().manual_seed(0)
    for split in ('train', 'test'):
        for label, name in enumerate(('dark', 'bright')):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(IMAGES_PER_CLASS):
                pixels = (64 + 128 * label + 40 * torch.randn(SIZE, SIZE, 3, generator=gen))
                Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy()).save(
                    folder / f'{i}.png')


def _config(data_root: Path, model: dict, optimizer: dict, per_rank_batch: int) -> str:
    """mmpretrain's config text: model, CustomDataset, EMAHook, Accuracy."""
    pipeline = [dict(type='LoadImageFromFile'), dict(type='PackInputs')]

    def loader(split: str, shuffle: bool) -> dict:
        # persistent_workers: mmpretrain's default (True) needs num_workers > 0
        return dict(batch_size=per_rank_batch, num_workers=0, persistent_workers=False,
                    dataset=dict(type='CustomDataset', data_root=str(data_root),
                                 data_prefix=split, pipeline=pipeline),
                    sampler=dict(type='DefaultSampler', shuffle=shuffle, seed=0))

    cfg = dict(
        default_scope='mmpretrain',
        model=model,
        data_preprocessor=dict(num_classes=2, mean=[127.5] * 3, std=[127.5] * 3, to_rgb=True),
        train_dataloader=loader('train', True),
        val_dataloader=loader('test', False), val_evaluator=dict(type='Accuracy', topk=(1, )),
        test_dataloader=loader('test', False), test_evaluator=dict(type='Accuracy', topk=(1, )),
        optim_wrapper=dict(optimizer=optimizer),
        train_cfg=dict(by_epoch=True, max_epochs=2, val_interval=2), val_cfg=dict(),
        test_cfg=dict(),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=2),
                           logger=dict(type='LoggerHook', interval=1)),
        custom_hooks=[dict(type='EMAHook', momentum=0.1, priority='ABOVE_NORMAL')],
        randomness=dict(seed=0),
        log_level='INFO',
    )
    return '\n'.join(f'{k} = {v!r}' for k, v in cfg.items()) + '\n'


def _mmfsdp_additions(wrapper: str, layer_cls: List[str]) -> str:
    """The only lines mmfsdp adds to the config."""
    cfg = dict(type=wrapper)
    if wrapper != 'mmfsdp.MMDistributedDataParallel':
        cfg['auto_wrap_policy'] = dict(type='transformer', layer_cls=layer_cls)
    return (f"runner_type = 'mmfsdp.FSDPRunner'\nmodel_wrapper_cfg = {cfg!r}\n"
            "custom_imports = dict(imports=['mmfsdp'], allow_failed_imports=False)\n"
            "env_cfg = dict(dist_cfg=dict(backend='gloo'))\n")












@pytest.fixture(scope='module')
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('pngs')
    _write_pngs(root)
    return root


@pytest.fixture(scope='module')
def stock(data_root, tmp_path_factory):
    """mmpretrain's tools/train.py and test.py on one process, no mmfsdp; memoised per model."""
    cache = {}

    def run(model: str) -> dict:
        if model not in cache:
            model_cfg, _, optimizer = MODELS[model]
            work = tmp_path_factory.mktemp(f'stock-{model}')
            cfg = write_config(tmp_path_factory,
                                _config(data_root, model_cfg, optimizer, GLOBAL_BATCH))
            run_tool([sys.executable, str(TOOLS / 'train.py'), str(cfg), '--work-dir', str(work)],
                 stock=True)
            out = run_tool([sys.executable, str(TOOLS / 'test.py'), str(cfg),
                        str(work / 'epoch_2.pth'), '--work-dir', str(work / 'test')], stock=True)
            cache[model] = dict(weights=checkpoint_weights(work / 'epoch_2.pth'),
                                top1=float(TOP1.findall(out)[-1]))
        return cache[model]

    return run


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
@pytest.mark.parametrize('model', list(MODELS))
def test_mmpretrain_tools_equal_one_process(model, wrapper, data_root, stock, tmp_path,
                                            tmp_path_factory):
    model_cfg, layer_cls, optimizer = MODELS[model]
    cfg = write_config(tmp_path_factory,
                        _config(data_root, model_cfg, optimizer, GLOBAL_BATCH // 2)
                        + _mmfsdp_additions(WRAPPERS[wrapper], layer_cls))
    run_tool(torchrun(TOOLS / 'train.py', str(cfg), '--work-dir', str(tmp_path)))
    out = run_tool(torchrun(TOOLS / 'test.py', str(cfg), str(tmp_path / 'epoch_2.pth'),
                         '--work-dir', str(tmp_path / 'test')))
    ref = stock(model)
    got = checkpoint_weights(tmp_path / 'epoch_2.pth')
    assert sorted(got) == sorted(ref['weights'])
    diff = max((got[k] - ref['weights'][k]).abs().max().item() for k in got)
    print(f'{model}/{wrapper}: max abs diff {diff:.2e}, top1 {TOP1.findall(out)[-1]}'
          f' (one process {ref["top1"]})')
    assert diff <= TOL
    assert float(TOP1.findall(out)[-1]) == ref['top1']


# ---- mmpretrain's shipped FlexibleRunner configs, only runner_type changed (issue 37) -------

CONFIGS = TOOLS.parent / 'configs' / 'mae' / 'benchmarks'
#: What makes the shipped ViT-L configs small: a 2-layer, 64-wide ViT on 32x32 PNGs, one epoch,
#: no validation, gloo (a CPU host); everything else is the shipped config.
SMALL = [
    'model.backbone.arch._delete_=True', 'model.backbone.arch.embed_dims=64',
    'model.backbone.arch.num_layers=2', 'model.backbone.arch.num_heads=2',
    'model.backbone.arch.feedforward_channels=128', 'model.backbone.img_size=32',
    'model.backbone.patch_size=8', 'model.backbone.init_cfg=None', 'model.head.in_channels=64',
    'model.head.num_classes=2', 'model.train_cfg=None', 'data_preprocessor.num_classes=2',
    'train_dataloader.batch_size=2', 'train_dataloader.num_workers=0',
    'train_dataloader.persistent_workers=False', 'train_dataloader.dataset.pipeline.1.scale=32',
    'train_dataloader.dataset.metainfo.classes=[dark,bright]', 'val_dataloader=None',
    'val_cfg=None', 'val_evaluator=None', 'train_cfg.max_epochs=1',
    'env_cfg.dist_cfg.backend=gloo']
#: name: (shipped config, its strategy made small, the same run in mmfsdp's own keys)
SHIPPED = dict(
    fsdp=('vit-large-p16_8xb128-fsdp-coslr-50e_in1k.py',
          ['strategy.model_wrapper.auto_wrap_policy.min_num_params=1e4'],
          ['model_wrapper_cfg.type=mmfsdp.MMFullyShard',
           'model_wrapper_cfg.auto_wrap_policy.type=size_based',
           'model_wrapper_cfg.auto_wrap_policy.min_num_params=10000',
           'default_hooks.checkpoint.state_dict_type=sharded']),  # FSDPStrategy's 'local'
    deepspeed_zero1=('vit-large-p16_8xb128-ds-coslr-50e_in1k.py', [],
                     ['model_wrapper_cfg.type=mmfsdp.MMFullyShard',
                      'model_wrapper_cfg.reshard_after_forward=False']),
    deepspeed_zero3=('vit-large-p16_8xb128-ds-coslr-50e_in1k.py',
                     ['strategy.zero_optimization.stage=3'],
                     ['model_wrapper_cfg.type=mmfsdp.MMFullyShard',
                      'model_wrapper_cfg.reshard_after_forward=True']),
)
DS_NATIVE_OPTIM = ['optim_wrapper.type=mmfsdp.AmpOptimWrapper', 'optim_wrapper.dtype=float16',
                   'optim_wrapper.loss_scale.init_scale=32768.0',
                   'optim_wrapper.loss_scale.growth_interval=500']


@pytest.mark.parametrize('name', list(SHIPPED))
def test_shipped_flexible_runner_config_shards_and_equals_native_keys(name, data_root,
                                                                       tmp_path):
    config, strategy, native = SHIPPED[name]
    if name.startswith('deepspeed'):
        native = native + DS_NATIVE_OPTIM
    common = SMALL + [f'train_dataloader.dataset.data_root={data_root}',
                      'runner_type=mmfsdp.FSDPRunner']
    runs = dict(strategy=common + strategy, native=common + native + ['strategy=None'])
    weights, logs = {}, {}
    for run, options in runs.items():
        work = tmp_path / run
        logs[run] = run_tool(torchrun(TOOLS / 'train.py', str(CONFIGS / config), '--work-dir',
                                      str(work), '--cfg-options', *options))
        weights[run] = checkpoint_weights(work / 'epoch_1.pth')
    assert "runs as mmfsdp's keys" in logs['strategy']
    assert "runs as mmfsdp's keys" not in logs['native']
    for run in runs:
        assert 'Sharding plan:\nmmfsdp.MMFullyShard' in logs[run], run
    diff = max((weights['strategy'][k] - weights['native'][k]).abs().max().item()
               for k in weights['native'])
    print(f'{name}: max abs diff to the native keys {diff:.1e}')
    assert sorted(weights['strategy']) == sorted(weights['native']) and diff == 0.0


# ---- a Python-style config inheriting a Python-style config (issue 37 §3) ------------------

#: The parent, written as mmpretrain's Python-style configs are (``mmpretrain/configs/_base_``:
#: the classes imported, given as ``type``), which its wheel does not ship: the ViT run of
#: ``_config`` (the ``stock('vit')`` run) in that form.
PYTHON_STYLE_BASE = """\
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, EMAHook, LoggerHook
from torch.optim import SGD

from mmpretrain.datasets import CustomDataset, LoadImageFromFile, PackInputs
from mmpretrain.evaluation import Accuracy
from mmpretrain.models import (ClsDataPreprocessor, CrossEntropyLoss, ImageClassifier,
                               VisionTransformer, VisionTransformerClsHead)

model = dict(
    type=ImageClassifier,
    backbone=dict(type=VisionTransformer, img_size=32, patch_size=8,
                  arch=dict(embed_dims=64, num_layers=2, num_heads=2, feedforward_channels=128)),
    neck=None,
    head=dict(type=VisionTransformerClsHead, num_classes=2, in_channels=64,
              loss=dict(type=CrossEntropyLoss, loss_weight=1.0)))
data_preprocessor = dict(type=ClsDataPreprocessor, num_classes=2, mean=[127.5] * 3,
                         std=[127.5] * 3, to_rgb=True)
train_dataloader = dict(
    batch_size=BATCH, num_workers=0, persistent_workers=False,
    dataset=dict(type=CustomDataset, data_root=DATA_ROOT, data_prefix='train',
                 pipeline=[dict(type=LoadImageFromFile), dict(type=PackInputs)]),
    sampler=dict(type=DefaultSampler, shuffle=True, seed=0))
val_dataloader = dict(
    batch_size=BATCH, num_workers=0, persistent_workers=False,
    dataset=dict(type=CustomDataset, data_root=DATA_ROOT, data_prefix='test',
                 pipeline=[dict(type=LoadImageFromFile), dict(type=PackInputs)]),
    sampler=dict(type=DefaultSampler, shuffle=False, seed=0))
val_evaluator = dict(type=Accuracy, topk=(1, ))
optim_wrapper = dict(optimizer=dict(type=SGD, lr=0.05, momentum=0.9, weight_decay=0.0))
train_cfg = dict(by_epoch=True, max_epochs=2, val_interval=2)
val_cfg = dict()
default_hooks = dict(checkpoint=dict(type=CheckpointHook, interval=2),
                     logger=dict(type=LoggerHook, interval=1))
custom_hooks = [dict(type=EMAHook, momentum=0.1, priority='ABOVE_NORMAL')]
randomness = dict(seed=0)
log_level = 'INFO'
"""
#: The user's config: the parent and mmfsdp's lines, its classes imported too.
PYTHON_STYLE_FSDP = """\
from mmengine.config import read_base

from mmfsdp import FSDPRunner, MMFullyShard
from mmpretrain.models.backbones.vision_transformer import TransformerEncoderLayer

with read_base():
    from .._base_.vit_tiny import *

runner_type = FSDPRunner
model_wrapper_cfg = dict(
    type=MMFullyShard,
    auto_wrap_policy=dict(type='transformer', layer_cls=[TransformerEncoderLayer]))
env_cfg = dict(dist_cfg=dict(backend='gloo'))
"""


def test_python_style_config_trains_through_mmpretrain_tools(data_root, stock, tmp_path,
                                                             tmp_path_factory):
    configs = tmp_path_factory.mktemp('python-style')
    (configs / '_base_').mkdir()
    (configs / 'vision_transformer').mkdir()
    (configs / '_base_' / 'vit_tiny.py').write_text(PYTHON_STYLE_BASE.replace(
        'BATCH', str(GLOBAL_BATCH // 2)).replace('DATA_ROOT', repr(str(data_root))))
    cfg = configs / 'vision_transformer' / 'vit_tiny_fsdp.py'
    cfg.write_text(PYTHON_STYLE_FSDP)
    log = run_tool(torchrun(TOOLS / 'train.py', str(cfg), '--work-dir', str(tmp_path)))
    assert re.search(r'Sharding plan:\nmmfsdp.MMFullyShard .*, 2 units \+ root', log)
    ref = stock('vit')
    got = checkpoint_weights(tmp_path / 'epoch_2.pth')
    assert sorted(got) == sorted(ref['weights'])
    diff = max((got[k] - ref['weights'][k]).abs().max().item() for k in got)
    print(f'Python-style config, FSDP2 at 2 ranks: max abs diff to one process {diff:.2e}')
    assert diff <= TOL
