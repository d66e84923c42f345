"""mmsegmentation's own ``tools/train.py`` trains a shipped FCN under FSDP2 and DDP.

A dense-prediction model from a second real zoo, run the way its users run it:
the config inherits mmseg's shipped ``fcn/fcn_r18-d8_4xb2-80k_cityscapes-512x1024.py``
(``EncoderDecoder``, dilated ``ResNetV1c``-18, ``FCNHead`` + auxiliary head,
``SegDataPreProcessor``, SGD + ``PolyLR``, ``IoUMetric``) and changes only what a
tiny dataset of generated images and masks needs. mmfsdp adds ``runner_type``,
``model_wrapper_cfg``, ``custom_imports`` and the backend. Each 2-rank job
(torchrun, global batch 4) is compared with mmseg's stock one-process run of
the same batch: final weights within 2e-5, the validation mIoU that ends
training (run under the wrapper at 2 ranks) equal, and mmseg's own
``tools/test.py`` reads mmfsdp's checkpoint with torch's safe loader.

Both runs read the same config text but for the per-rank batch and mmfsdp's
lines. The backbone keeps the shipped ``SyncBN``: mmengine's Runner reverts it
to ``BatchNorm`` when it runs undistributed, and ``FSDPRunner`` does so on a
host without an accelerator (torch's ``SyncBatchNorm`` needs one); it logs the
modules. What else differs from the shipped config, so that one process stays
the reference of a 2-rank run:
- ``norm_eval=True`` freezes the backbone's BN statistics (per-rank batch
  statistics would differ from one process beyond rounding), and the heads use
  ``GN`` instead of the shipped ``SyncBN`` for the same reason (GroupNorm is per
  sample); ``dropout_ratio=0``: each rank would draw its own dropout masks;
- no random augmentation (each rank would draw its own), no pretrained download,
  6 iterations (the shipped SGD, lr 0.01, ``PolyLR`` over them): enough to
  reach a validation mIoU around 77, not a trivial all-background 42.

Needs the environment of ``tools/zoo_env.sh`` (mmsegmentation 1.2.2 and an mmcv
2.1.0 built with its ops: mmseg imports ``mmcv.ops`` at module level); skipped,
with the reason, otherwise. Marked ``zoo``: select it with ``-m zoo``.
"""
import re
import sys
from pathlib import Path

import pytest
import torch
from zoo_jobs import checkpoint_weights, run_tool, torchrun, write_config

pytestmark = pytest.mark.zoo


def _import_zoo():
    try:
        import mmseg
        import mmseg.models  # noqa: F401  (imports mmcv.ops: fails without the compiled ops)
    except Exception as e:
        pytest.skip(f'mmseg cannot be imported here (tools/zoo_env.sh builds an env where it '
                    f'can): {type(e).__name__}: {e}', allow_module_level=True)
    tools = Path(mmseg.__file__).parent / '.mim' / 'tools'
    if not (tools / 'train.py').exists():
        pytest.skip(f'mmseg is installed without its tools ({tools}/train.py); install the '
                    'wheel from PyPI', allow_module_level=True)
    return tools


TOOLS = _import_zoo()
# Measured: 2.1e-6 under both wrappers (FSDP2 and DDP within 1.5e-8 of each other): the batch
# split's rounding, grown by training. With a constant lr, one process accumulating the two
# half-batches the ranks take ([0, 2] and [1, 3] of each global batch) was bit-equal to the DDP
# run and, like it, 8.4e-5 from the batch-4 run; step by step the runs were a ulp apart after
# step 1 and parted at step 3, where a ulp-level difference changed the gradient of one
# BatchNorm bias of the last stage discretely, and momentum carried that on.
TOL = 2e-5
TRAIN_IMAGES, VAL_IMAGES, SIZE, GLOBAL_BATCH, ITERS = 8, 4, 64, 4, 6
MIOU = re.compile(r'mIoU: ([0-9.]+)')
CHECKPOINT = f'iter_{ITERS}.pth'

SHIPPED = 'mmseg::fcn/fcn_r18-d8_4xb2-80k_cityscapes-512x1024.py'
GN = dict(type='GN', num_groups=32, requires_grad=True)
PREPROCESSOR = dict(size=(SIZE, SIZE))  # pads to this size; the images already have it
MODEL = dict(
    data_preprocessor=PREPROCESSOR,
    pretrained=None,
    backbone=dict(norm_eval=True),
    decode_head=dict(num_classes=2, dropout_ratio=0.0, norm_cfg=GN),
    auxiliary_head=dict(num_classes=2, dropout_ratio=0.0, norm_cfg=GN))
WRAPPERS = dict(fsdp2='mmfsdp.MMFullyShard', ddp='mmfsdp.MMDistributedDataParallel')


def _write_data(root: Path) -> None:
    """Dark noisy images with one bright square (a quarter to half of the image; the mask
    marks it): ``root/{img,ann}/{split}``."""
    from PIL import Image
    gen = torch.Generator().manual_seed(0)
    for split, count in (('train', TRAIN_IMAGES), ('val', VAL_IMAGES)):
        (root / 'img' / split).mkdir(parents=True)
        (root / 'ann' / split).mkdir(parents=True)
        for i in range(count):
            side = int(torch.randint(32, 49, (), generator=gen))
            y, x = (int(v) for v in torch.randint(0, SIZE - side + 1, (2, ), generator=gen))
            mask = torch.zeros(SIZE, SIZE, dtype=torch.uint8)
            mask[y:y + side, x:x + side] = 1
            pixels = 64 + 128 * mask[..., None] + 40 * torch.randn(SIZE, SIZE, 3, generator=gen)
            Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy()).save(
                root / 'img' / split / f'{i}.png')
            Image.fromarray(mask.numpy()).save(root / 'ann' / split / f'{i}.png')


def _config(data_root: Path, per_rank_batch: int) -> str:
    """The shipped FCN config, pointed at the generated data."""
    pipeline = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
                dict(type='PackSegInputs')]

    def loader(split: str, batch: int, sampler: dict) -> dict:
        # persistent_workers: the shipped default (True) needs num_workers > 0
        return dict(batch_size=batch, num_workers=0, persistent_workers=False, sampler=sampler,
                    dataset=dict(_delete_=True, type='BaseSegDataset', data_root=str(data_root),
                                 data_prefix=dict(img_path=f'img/{split}',
                                                  seg_map_path=f'ann/{split}'),
                                 img_suffix='.png', seg_map_suffix='.png',
                                 metainfo=dict(classes=('background', 'square'),
                                               palette=[[0, 0, 0], [255, 255, 255]]),
                                 pipeline=pipeline))

    val = loader('val', 1, dict(type='DefaultSampler', shuffle=False))
    cfg = dict(
        _base_=[SHIPPED],
        data_preprocessor=PREPROCESSOR,  # the shipped top-level one, as the model's
        model=MODEL,
        # seed: the same shuffled order in one process and at 2 ranks
        train_dataloader=loader('train', per_rank_batch,
                                dict(type='InfiniteSampler', shuffle=True, seed=0)),
        val_dataloader=val, test_dataloader=val,
        train_cfg=dict(max_iters=ITERS, val_interval=ITERS),
        param_scheduler=[dict(type='PolyLR', eta_min=1e-4, power=0.9, begin=0, end=ITERS,
                              by_epoch=False)],
        default_hooks=dict(checkpoint=dict(interval=ITERS), logger=dict(interval=1)),
        randomness=dict(seed=0),
    )
    return '\n'.join(f'{k} = {v!r}' for k, v in cfg.items()) + '\n'


def _mmfsdp_additions(wrapper: str) -> str:
    """The only lines mmfsdp adds to the config."""
    cfg = dict(type=wrapper)
    if wrapper != 'mmfsdp.MMDistributedDataParallel':
        cfg['auto_wrap_policy'] = dict(type='transformer', layer_cls=['BasicBlock'])
    return (f"runner_type = 'mmfsdp.FSDPRunner'\nmodel_wrapper_cfg = {cfg!r}\n"
            "custom_imports = dict(imports=['mmfsdp'], allow_failed_imports=False)\n"
            "env_cfg = dict(dist_cfg=dict(backend='gloo'))\n")








@pytest.fixture(scope='module')
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('seg')
    _write_data(root)
    return root


@pytest.fixture(scope='module')
def stock(data_root, tmp_path_factory) -> dict:
    """mmseg's tools/train.py on one process, no mmfsdp: its config, weights and final mIoU."""
    work = tmp_path_factory.mktemp('stock')
    cfg = write_config(tmp_path_factory, _config(data_root, GLOBAL_BATCH))
    out = run_tool([sys.executable, str(TOOLS / 'train.py'), str(cfg), '--work-dir', str(work)],
               stock=True)
    return dict(config=cfg, weights=checkpoint_weights(work / CHECKPOINT),
                miou=float(MIOU.findall(out)[-1]))


@pytest.fixture(scope='module')
def trained(data_root, tmp_path_factory):
    """mmseg's tools/train.py at 2 ranks (torchrun) under a wrapper; memoised per wrapper."""
    cache = {}

    def run(wrapper: str) -> dict:
        if wrapper not in cache:
            work = tmp_path_factory.mktemp(wrapper)
            cfg = write_config(tmp_path_factory,
                                _config(data_root, GLOBAL_BATCH // 2)
                                + _mmfsdp_additions(WRAPPERS[wrapper]))
            out = run_tool(torchrun(TOOLS / 'train.py', str(cfg), '--work-dir', str(work)))
            cache[wrapper] = dict(checkpoint=work / CHECKPOINT,
                                  weights=checkpoint_weights(work / CHECKPOINT),
                                  miou=float(MIOU.findall(out)[-1]))
        return cache[wrapper]

    return run


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_mmseg_fcn_weights_equal_one_process(wrapper, trained, stock):
    got, ref = trained(wrapper)['weights'], stock['weights']
    assert sorted(got) == sorted(ref)
    diff = max((got[k] - ref[k]).abs().max().item() for k in got)
    print(f'fcn/{wrapper}: max abs weight diff {diff:.2e}')
    assert diff <= TOL


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_mmseg_fcn_val_miou_equal_one_process(wrapper, trained, stock):
    """The validation that ends training runs under the wrapper, each rank on half the images."""
    got = trained(wrapper)['miou']
    print(f'fcn/{wrapper}: mIoU {got} (one process {stock["miou"]})')
    assert got == stock['miou']


def test_mmseg_test_py_reads_mmfsdp_checkpoint(trained, stock, tmp_path):
    """mmseg's own test.py (stock Runner, one process) loads FSDP2's full checkpoint with
    torch's default ``weights_only`` loader, and evaluates it to the one-process mIoU."""
    out = run_tool([sys.executable, str(TOOLS / 'test.py'), str(stock['config']),
                str(trained('fsdp2')['checkpoint']), '--work-dir', str(tmp_path)])
    assert float(MIOU.findall(out)[-1]) == stock['miou']
