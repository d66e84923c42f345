"""mmdet 3.3.0's ``SyncNormHook`` (YOLOX's configs) under FSDPRunner runs as mmfsdp's.

A YOLOX backbone (mmdet's ``CSPDarknet``, deepen 0.33, widen 0.125, YOLOX's
``BN(momentum=0.03, eps=0.001)``: 35 BatchNorms; loss: mean square of its outputs)
trains 5 iterations at 2 ranks with validation after 2, 4 and 5, on images whose
odd samples are scaled and shifted (an unshuffled sampler gives each rank its
own statistics). ``default_scope='mmdet'``, as mmdet's configs: the hook is named
as YOLOX's configs name it (``dict(type='SyncNormHook', priority=48)``, under
FSDP2), by mmdet's class (as a Python-style config's ``custom_hooks`` entry is
registered, under FSDP1) and with the scope
(``'mmdet.SyncNormHook'``, under DDP). The reference is mmdet's own hook object
under DDP (registered as an object: FSDPRunner replaces only configs). Every rank's
statistics after the hook are the fp32 mean of the ranks' and equal the
reference's, and so does the training. Before the replacement mmdet's hook
failed under FSDP2 (``aten.cat.default got mixed torch.Tensor and DTensor``).

Needs the environment of ``tools/zoo_env.sh`` (mmdet imports ``mmcv.ops``); skipped, with the
reason, otherwise. Marked ``zoo``: select it with ``-m zoo``.
"""
import os
from typing import Any, Dict

import pytest
import torch
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch.utils.data import Dataset

from harness import max_abs_diff, run_distributed, scalar_history
from toy import NormRecorder, runner_config

pytestmark = pytest.mark.zoo

try:
    from mmdet.engine.hooks import SyncNormHook as MmdetSyncNormHook
    from mmdet.models.backbones import CSPDarknet
except Exception as e:
    pytest.skip(f'mmdet cannot be imported here (tools/zoo_env.sh builds an env where it can): '
                f'{type(e).__name__}: {e}', allow_module_level=True)

ITERS, VAL_INTERVAL, VALIDATIONS = 5, 2, 3
#: The runs: wrapper, and the hook as the config names it (None: mmdet's hook object).
RUNS = {'ddp-mmdet': ('ddp', None), 'fsdp2': ('fsdp2', 'SyncNormHook'),
        'fsdp1': ('fsdp1', MmdetSyncNormHook), 'ddp': ('ddp', 'mmdet.SyncNormHook')}
UNITS = dict(auto_wrap_policy=dict(type='transformer', layer_cls=['CSPLayer']))
WRAPPERS = {'ddp': dict(type='mmfsdp.MMDistributedDataParallel'),
            'fsdp2': dict(type='mmfsdp.MMFullyShard', **UNITS),
            'fsdp1': dict(type='mmfsdp.MMFullyShardedDataParallel', **UNITS)}


@MODELS.register_module()
class YoloxBackboneZoo(BaseModel):
    """mmdet's ``CSPDarknet`` as YOLOX builds it, small; loss: mean square of the outputs."""

    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.backbone = CSPDarknet(deepen_factor=0.33, widen_factor=0.125,
                                   norm_cfg=dict(type='BN', momentum=0.03, eps=0.001))

    def forward(self, inputs, data_samples=None, mode='tensor'):
        outs = self.backbone(inputs)
        if mode == 'loss':
            return dict(loss=sum(out.pow(2).mean() for out in outs))
        if mode == 'predict':  # read by toy's ToyMetric
            score = sum(out.pow(2).flatten(1).mean(1) for out in outs)
            return [dict(nll=s, correct=torch.tensor(0.0)) for s in score.cpu()]
        return outs


@DATASETS.register_module()
class ParityImages(Dataset):
    """Seeded 3 x 32 x 32 images; the odd ones scaled by 3 and shifted by 2."""

    def __init__(self, length: int = 48, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(length, 3, 32, 32, generator=gen)
        self.images[1::2] = self.images[1::2] * 3 + 2

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return dict(inputs=self.images[i])


def _train(root: str, name: str) -> Dict[str, Any]:
    from mmfsdp import FSDPRunner
    wrapper, hook = RUNS[name]
    cfg = runner_config(name, os.path.join(root, name), wrapper=WRAPPERS[wrapper], batch_size=4,
                        max_iters=ITERS, val=True)
    cfg.update(default_scope='mmdet', model=dict(type='YoloxBackboneZoo'))
    for loader in ('train_dataloader', 'val_dataloader'):
        cfg[loader]['dataset']['type'] = 'ParityImages'
    cfg['train_dataloader']['sampler'] = dict(type='DefaultSampler', shuffle=False)
    cfg['train_cfg']['val_interval'] = VAL_INTERVAL
    cfg['custom_hooks'] = [dict(type='NormRecorder', label='before', priority=40),
                           dict(type='NormRecorder', label='after', priority=50)]
    if isinstance(hook, str):
        cfg['custom_hooks'].append(dict(type=hook, priority=48))  # as in YOLOX's configs
    runner = FSDPRunner.from_cfg(Config(cfg))
    if hook is None:
        runner.register_hook(MmdetSyncNormHook(), priority=48)
    elif not isinstance(hook, str):  # the class (a Python-style config; not dumpable here)
        runner.register_hook(dict(type=hook, priority=48))
    runner.train()
    out: Dict[str, Any] = {h.label: h.records for h in runner.hooks
                           if isinstance(h, NormRecorder)}
    out['hook'] = [f'{type(h).__module__}.{type(h).__name__}' for h in runner.hooks
                   if type(h).__name__ == 'SyncNormHook']
    out['loss'] = torch.tensor(scalar_history(runner, 'train/loss'))
    return out


def _two_ranks(root: str) -> Dict[str, Any]:
    import mmfsdp  # noqa: F401  (registers the 'mmfsdp.' names)
    return {name: _train(root, name) for name in RUNS}


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp('syncnorm')), timeout=600)


@pytest.mark.parametrize('run', list(RUNS))
def test_the_hook_gives_every_rank_the_fp32_mean_of_the_batchnorm_statistics(ranks, run):
    module = 'mmdet.engine.hooks.sync_norm_hook' if run == 'ddp-mmdet' else 'mmfsdp.sync_norm'
    assert ranks[0][run]['hook'] == [f'{module}.SyncNormHook']
    for i in range(VALIDATIONS):
        before = [rank[run]['before'][i] for rank in ranks]
        assert sum(k.endswith('running_mean') for k in before[0]) == 35
        running = [{k: v for k, v in b.items() if 'running' in k} for b in before]
        assert max_abs_diff(*running) > 0.1  # the ranks' statistics part
        mean = {k: (before[0][k].float() + before[1][k].float()).div(2).to(before[0][k].dtype)
                for k in before[0]}
        for rank in ranks:
            assert max_abs_diff(rank[run]['after'][i], mean) == 0, (run, i)


@pytest.mark.parametrize('run', ['fsdp2', 'fsdp1', 'ddp'])
def test_statistics_and_training_equal_mmdets_hook_under_ddp(ranks, run):
    for rank in ranks:
        reference = rank['ddp-mmdet']
        for after, stock in zip(rank[run]['after'], reference['after'], strict=True):
            assert max_abs_diff(after, stock) == 0, run
        assert max_abs_diff(dict(loss=rank[run]['loss']), dict(loss=reference['loss'])) == 0
