"""mmdetection's large-model example, a Python-style config, loads and plans under FSDPRunner.

``projects/example_largemodel/dino-5scale_swin-l_fsdp_8xb2-12e_coco.py`` is written below as
mmdet ships it but for two lines: ``runner_type`` (``'FlexibleRunner'`` there; the one-line
change of docs/configuration.md) and its parent's import. It inherits
``mmdet.configs.dino.dino_5scale_swin_l_8xb2_12e_coco``, which the mmdet 3.3.0 wheel does not ship
(``mmdet/configs/`` is only in a source checkout; mmengine reads ``from mmdet.configs.x import *``
from the installed package's directory), so the parent is written beside it, trimmed to what
the plan reads (the model of mmdet's DINO Swin-L chain and its optim wrapper, imported classes
as ``type``), and imported relatively. ``projects.example_largemodel`` holds the callable
policy in the shape of mmdet's (``name_auto_wrap_policy``: a ``SwinBlock`` or a deformable
encoder layer is a unit). Its ``FSDPStrategy`` with that imported callable is translated to
``mmfsdp.MMFullyShard``, and ``python -m mmfsdp.plan`` plans a Swin made tiny with
``--cfg-options``: the units are the Swin blocks and encoder layers the policy names.

Needs the environment of ``tools/zoo_env.sh`` (mmdet 3.3.0 with an mmcv built with its ops);
skipped, with the reason, otherwise. Marked ``zoo``: select it with ``-m zoo``.
"""
import re
import sys
from pathlib import Path

import pytest
from mmengine.config import Config

from harness import REPO, job_env, run_job

pytestmark = pytest.mark.zoo

try:
    import mmdet.models  # noqa: F401  (imports mmcv.ops: fails without the compiled ops)
except Exception as e:
    pytest.skip(f'mmdet cannot be imported here (tools/zoo_env.sh builds an env where it can): '
                f'{type(e).__name__}: {e}', allow_module_level=True)

POLICY = """\
from mmdet.models.backbones.swin import SwinBlock
from mmdet.models.layers.transformer.deformable_detr_layers import \\
    DeformableDetrTransformerEncoderLayer


def name_auto_wrap_policy(module, recurse, nonwrapped_numel, layer_cls=None):
    return recurse or isinstance(module, (SwinBlock, DeformableDetrTransformerEncoderLayer))
"""
#: mmdet's dino_5scale_swin_l_8xb2_12e_coco.py with its parent dino_4scale_r50_8xb2_12e_coco.py,
#: the model and optim wrapper only.
PARENT = """\
from mmengine.model.weight_init import PretrainedInit
from mmengine.optim.optimizer.optimizer_wrapper import OptimWrapper
from torch.nn import GroupNorm
from torch.optim.adamw import AdamW

from mmdet.models import DINO, ChannelMapper, DetDataPreprocessor, DINOHead, SwinTransformer
from mmdet.models.losses.focal_loss import FocalLoss
from mmdet.models.losses.iou_loss import GIoULoss
from mmdet.models.losses.smooth_l1_loss import L1Loss
from mmdet.models.task_modules import BBoxL1Cost, FocalLossCost, HungarianAssigner, IoUCost

pretrained = ('https://github.com/SwinTransformer/storage/releases/download/v1.0.0/'
              'swin_large_patch4_window12_384_22k.pth')
num_levels = 5
model = dict(
    type=DINO, num_queries=900, with_box_refine=True, as_two_stage=True,
    num_feature_levels=num_levels,
    data_preprocessor=dict(type=DetDataPreprocessor, mean=[123.675, 116.28, 103.53],
                           std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_size_divisor=1),
    backbone=dict(
        type=SwinTransformer, pretrain_img_size=384, embed_dims=192, depths=[2, 2, 18, 2],
        num_heads=[6, 12, 24, 48], window_size=12, mlp_ratio=4, qkv_bias=True, qk_scale=None,
        drop_rate=0., attn_drop_rate=0., drop_path_rate=0.2, patch_norm=True,
        out_indices=(0, 1, 2, 3), with_cp=True, convert_weights=True,
        init_cfg=dict(type=PretrainedInit, checkpoint=pretrained)),
    neck=dict(type=ChannelMapper, in_channels=[192, 384, 768, 1536], kernel_size=1,
              out_channels=256, act_cfg=None, norm_cfg=dict(type=GroupNorm, num_groups=32),
              num_outs=num_levels),
    encoder=dict(num_layers=6, layer_cfg=dict(
        self_attn_cfg=dict(embed_dims=256, num_levels=num_levels, dropout=0.0),
        ffn_cfg=dict(embed_dims=256, feedforward_channels=2048, ffn_drop=0.0))),
    decoder=dict(num_layers=6, return_intermediate=True, layer_cfg=dict(
        self_attn_cfg=dict(embed_dims=256, num_heads=8, dropout=0.0),
        cross_attn_cfg=dict(embed_dims=256, num_levels=num_levels, dropout=0.0),
        ffn_cfg=dict(embed_dims=256, feedforward_channels=2048, ffn_drop=0.0)),
        post_norm_cfg=None),
    positional_encoding=dict(num_feats=128, normalize=True, offset=0.0, temperature=20),
    bbox_head=dict(type=DINOHead, num_classes=80, sync_cls_avg_factor=True,
                   loss_cls=dict(type=FocalLoss, use_sigmoid=True, gamma=2.0, alpha=0.25,
                                 loss_weight=1.0),
                   loss_bbox=dict(type=L1Loss, loss_weight=5.0),
                   loss_iou=dict(type=GIoULoss, loss_weight=2.0)),
    dn_cfg=dict(label_noise_scale=0.5, box_noise_scale=1.0,
                group_cfg=dict(dynamic=True, num_groups=None, num_dn_queries=100)),
    train_cfg=dict(assigner=dict(type=HungarianAssigner, match_costs=[
        dict(type=FocalLossCost, weight=2.0),
        dict(type=BBoxL1Cost, weight=5.0, box_format='xywh'),
        dict(type=IoUCost, iou_mode='giou', weight=2.0)])),
    test_cfg=dict(max_per_img=300))
optim_wrapper = dict(
    type=OptimWrapper, optimizer=dict(type=AdamW, lr=0.0001, weight_decay=0.0001),
    clip_grad=dict(max_norm=0.1, norm_type=2),
    paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=0.1)}))
"""
#: The example as mmdet ships it, but for runner_type and the parent's import (relative).
EXAMPLE = """\
from mmengine.config import read_base
from projects.example_largemodel import name_auto_wrap_policy

with read_base():
   from .dino_5scale_swin_l_8xb2_12e_coco import *

custom_imports = dict(
    imports=['projects.example_largemodel'], allow_failed_imports=False)

runner_type = 'mmfsdp.FSDPRunner'

strategy = dict(
    type='FSDPStrategy',
    model_wrapper=dict(
        auto_wrap_policy=dict(
            type=name_auto_wrap_policy)))
"""
#: A Swin-L made tiny (depths 1, 1, 2, 1 at width 32), two encoder and decoder layers.
TINY = ['model.backbone.embed_dims=32', 'model.backbone.depths=[1,1,2,1]',
        'model.backbone.num_heads=[1,2,4,8]', 'model.backbone.init_cfg=None',
        'model.neck.in_channels=[32,64,128,256]', 'model.encoder.num_layers=2',
        'model.decoder.num_layers=2']


@pytest.fixture
def example(tmp_path, monkeypatch) -> Path:
    """The example config, its parent, and ``projects/example_largemodel`` on the path."""
    package = tmp_path / 'projects' / 'example_largemodel'
    package.mkdir(parents=True)
    (tmp_path / 'projects' / '__init__.py').write_text('')
    (package / '__init__.py').write_text(POLICY)
    (tmp_path / 'configs').mkdir()
    (tmp_path / 'configs' / 'dino_5scale_swin_l_8xb2_12e_coco.py').write_text(PARENT)
    path = tmp_path / 'configs' / 'dino-5scale_swin-l_fsdp_8xb2-12e_coco.py'
    path.write_text(EXAMPLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def test_mmdet_example_config_loads_and_plans(example):
    from mmfsdp.wrappers.builder import model_wrapper_config
    cfg = Config.fromfile(str(example))
    policy = cfg.strategy.model_wrapper.auto_wrap_policy.type
    assert policy.__name__ == 'name_auto_wrap_policy'
    assert model_wrapper_config(cfg) == dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=policy)
    out = run_job([sys.executable, '-m', 'mmfsdp.plan', str(example), '--world-size', '2',
                   '--no-trace', '--cfg-options', *TINY],
                  env=job_env(REPO, example.parent.parent), merge_stderr=False)
    print(out)
    assert re.search(r'^mmfsdp\.MMFullyShard .*world size 2 .*, 7 units \+ root', out, re.M)
    units = re.findall(r'^(\S+) +(SwinBlock|DeformableDetrTransf)', out, re.M)
    assert [u for u, _ in units] == [
        'backbone.stages.0.blocks.0', 'backbone.stages.1.blocks.0', 'backbone.stages.2.blocks.0',
        'backbone.stages.2.blocks.1', 'backbone.stages.3.blocks.0', 'encoder.layers.0',
        'encoder.layers.1']
