"""Swin backbones that load a local Pretrained file, built on meta, equal the normal build.

mmdet 3.3.0's ``SwinTransformer`` reads ``init_cfg=dict(type='Pretrained')`` in its own
``init_weights``: it loads the file, interpolates each ``relative_position_bias_table``
against ``self.state_dict()`` and calls ``self.load_state_dict`` (mmseg's Swin does the same;
DINO, Mask2Former and Co-DETR configs take this path). mmpretrain 1.2.0's
``SwinTransformer`` loads through mmengine's ``init_cfg`` and resizes its tables in a
``load_state_dict`` pre-hook. Each is trained inside a tiny model (loss: mean square of the
stage outputs) by ``FSDPRunner`` at 2 ranks under FSDP2 (``SwinBlock`` units), from a file
saved by the same Swin with a smaller window (mmdet's: the tables are interpolated) or smaller
images (mmpretrain's: ``absolute_pos_embed`` is resized by its pre-hook): with
``init_device='meta'`` the weights equal the normal build (max abs diff 0) after init and
after 2 AdamW iterations. Before meta init took full tensors into shards, mmdet's Swin failed
at start-up ("While copying the parameter named ...") and mmpretrain's skipped the resized
``absolute_pos_embed`` as mis-shaped (it kept its constructor's zeros).

Needs the environment of ``tools/zoo_env.sh`` (mmdet imports ``mmcv.ops``); skipped, with the
reason, otherwise. Marked ``zoo``: select it with ``-m zoo``.
"""
import copy
import os

import pytest
import torch
from mmengine.config import Config, ConfigDict
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch.utils.data import Dataset

from harness import max_abs_diff, run_distributed
from toy import runner_config

pytestmark = pytest.mark.zoo

try:
    from mmdet.models.backbones import SwinTransformer as DetSwin
    from mmpretrain.models.backbones import SwinTransformer as PretrainSwin
except Exception as e:
    pytest.skip(f'mmdet / mmpretrain cannot be imported here (tools/zoo_env.sh builds an env '
                f'where they can): {type(e).__name__}: {e}', allow_module_level=True)

#: Small Swins of two stages (window 4, 32 x 32 images).
BACKBONES = {
    'mmdet': (DetSwin, dict(embed_dims=32, depths=(2, 2), num_heads=(2, 4), strides=(4, 2),
                            out_indices=(0, 1), drop_path_rate=0.0, window_size=4)),
    'mmpretrain': (PretrainSwin, dict(arch=dict(embed_dims=32, depths=[2, 2], num_heads=[2, 4]),
                                      img_size=32, out_indices=(0, 1), drop_path_rate=0.0,
                                      window_size=4, use_abs_pos_embed=True)),
}
#: What the file's Swin has otherwise. mmdet's: window 2, so its tables are interpolated (torch's
#: load_state_dict raises on the index buffers' other shape, eagerly too, so the file has none).
#: mmpretrain's: 16 x 16 images, so its pre-hook resizes absolute_pos_embed; its tables are not
#: resized here: mmpretrain 1.2.0 does that with scipy's interp2d, removed in SciPy 1.14.
FILE = {'mmdet': dict(window_size=2), 'mmpretrain': dict(img_size=16)}


@MODELS.register_module()
class SwinZoo(BaseModel):
    """A Swin backbone from ``BACKBONES``; the loss is the mean square of its outputs."""

    def __init__(self, kind: str = 'mmdet', checkpoint: str = '', file: bool = False,
                 data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        cls, cfg = BACKBONES[kind]
        init_cfg = None
        if checkpoint:  # as from a config; mmdet's Swin takes the 'backbone.' keys itself
            init_cfg = ConfigDict(type='Pretrained', checkpoint=checkpoint,
                                  **(dict(prefix='backbone') if kind == 'mmpretrain' else {}))
        self.backbone = cls(**dict(cfg, **(FILE[kind] if file else {})), init_cfg=init_cfg)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        outs = self.backbone(inputs)
        if mode == 'loss':
            return dict(loss=sum(out.pow(2).mean() for out in outs))
        return outs


@DATASETS.register_module()
class NoiseImages(Dataset):
    """``length`` seeded 3 x 32 x 32 images."""

    def __init__(self, length: int = 8) -> None:
        self.images = torch.randn(length, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return dict(inputs=self.images[i])


def _state(runner) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    state = gather_full_state(runner.model, None)[0]
    state.update(runner.model.module.named_buffers())
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _two_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401  (registers the 'mmfsdp.' names)
    from mmfsdp import FSDPRunner
    out = {}
    for kind in BACKBONES:
        torch.manual_seed(3)
        saved = SwinZoo(kind, file=True).state_dict()
        saved = {k: v.normal_() if v.is_floating_point() else v for k, v in saved.items()
                 if kind == 'mmpretrain' or 'relative_position_index' not in k}  # see below
        # the same file on both ranks, each its own copy (no process group yet)
        checkpoint = os.path.join(root, f'{kind}-{os.environ["RANK"]}.pth')
        torch.save(dict(state_dict=saved), checkpoint)
        out[f'{kind}/file'] = saved
        for init_device in (None, 'meta'):
            for iters in (0, 2):
                name = f'{kind}-{init_device}-{iters}'
                cfg = runner_config(name, f'{root}/{name}', batch_size=2, max_iters=iters,
                                    wrapper=dict(type='mmfsdp.MMFullyShard',
                                                 init_device=init_device,
                                                 auto_wrap_policy=dict(type='transformer',
                                                                       layer_cls=['SwinBlock'])))
                cfg['model'] = dict(type='SwinZoo', kind=kind, checkpoint=checkpoint)
                cfg['train_dataloader']['dataset'] = dict(type='NoiseImages')
                try:
                    runner = FSDPRunner.from_cfg(Config(copy.deepcopy(cfg)))
                    runner.train()
                    out[f'{kind}/{init_device}/{iters}'] = _state(runner)
                except Exception as e:  # noqa: BLE001  (the test shows the error)
                    out[f'{kind}/{init_device}/{iters}'] = f'{type(e).__name__}: {e}'
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> list:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp('swin')), timeout=500)


@pytest.mark.parametrize('kind', list(BACKBONES))
def test_swin_loading_pretrained_under_meta_init_equals_the_normal_build(runs, kind):
    for iters in (0, 2):
        meta, normal = runs[0][f'{kind}/meta/{iters}'], runs[0][f'{kind}/None/{iters}']
        assert isinstance(meta, dict), meta
        assert isinstance(normal, dict), normal
        assert meta.keys() == normal.keys()
        assert max_abs_diff(meta, normal) == 0, iters
    # the normal build starts from the file: equal where shapes agree, the rest resized
    start, saved = runs[0][f'{kind}/None/0'], runs[0][f'{kind}/file']
    same = [k for k in saved if saved[k].shape == start[k].shape]
    assert max_abs_diff({k: start[k] for k in same}, {k: saved[k] for k in same}) == 0
    resized = {'mmdet': 'relative_position_bias_table', 'mmpretrain': 'absolute_pos_embed'}[kind]
    assert sorted(set(saved) - set(same)) == sorted(k for k in saved if resized in k)
    assert len(same) > 20
