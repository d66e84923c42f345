"""mmdet's ``SyncNormHook`` (YOLOX's configs) under every wrapper: ``mmfsdp.SyncNormHook``.

mmdet is not installed here. ``MmdetSyncNormHook`` does what mmdet 3.3.0's hook
does (every ``_NormBase``'s ``state_dict()``, concatenated in fp32, summed,
divided by the world size, loaded back with ``strict=False``) and is registered
under mmdet's name, ``'SyncNormHook'``, as mmdet's registry would resolve it,
and as ``'StockSyncNormHook'``, a name FSDPRunner does not replace: the
reference run is that stock hook under DDP. Before the replacement the config
naming ``'SyncNormHook'`` ran it under FSDP2 (``torch.cat`` of plain tensors and
DTensors raises) and FSDP1 (each rank's slices of the flat shard: the ranks
all-reduce different sizes).

The ranks see different data (``ParityShiftedDataset``), so their running
statistics part. Two recorders keep each rank's buffers before and after the
hook at every validation (priorities 40 and 50 around YOLOX's 48).
"""
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, MODELS
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

import contract_models  # noqa: F401  (registers ParityShiftedDataset)
from harness import max_abs_diff, run_distributed, scalar_history
from toy import IN_DIM, WRAPPERS, NormRecorder, ToyClassifier, runner_config

#: Validation after iterations 2, 4 and 5 (the last).
ITERS, VAL_INTERVAL, VALIDATIONS = 5, 2, 3
#: The runs: the stock hook under DDP (the reference), then mmdet's name under each wrapper.
RUNS = {'ddp-stock': ('ddp', 'StockSyncNormHook'),
        **{name: (name, 'SyncNormHook') for name in WRAPPERS}}


@MODELS.register_module()
class BatchNormClassifier(ToyClassifier):
    """``ToyClassifier`` with BatchNorm after its embedding and inside its head (root unit)."""

    def __init__(self, dim: int = 16, **kwargs: Any) -> None:
        super().__init__(dim=dim, **kwargs)
        self.embed = nn.Sequential(nn.Linear(IN_DIM, dim), nn.BatchNorm1d(dim))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.BatchNorm1d(dim), nn.ReLU(),
                                  nn.Linear(dim, self.head.out_features))


@HOOKS.register_module(name=['SyncNormHook', 'StockSyncNormHook'])
class MmdetSyncNormHook(Hook):
    """What mmdet 3.3.0's ``SyncNormHook.before_val_epoch`` does, step by step."""

    def before_val_epoch(self, runner) -> None:
        states = {f'{name}.{key}': value for name, module in runner.model.named_modules()
                  if isinstance(module, _NormBase) for key, value in module.state_dict().items()}
        flat = torch.cat([v.flatten().float() for v in states.values()])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        means = [m.reshape(v.shape) for m, v in
                 zip(flat.split([v.numel() for v in states.values()]), states.values())]
        runner.model.load_state_dict(dict(zip(states, means)), strict=False)


def _train(root: str, name: str) -> Dict[str, Any]:
    from mmfsdp import FSDPRunner
    wrapper, hook = RUNS[name]
    cfg = runner_config(name, os.path.join(root, name), wrapper=WRAPPERS[wrapper], batch_size=4,
                        max_iters=ITERS, val=True)
    cfg['model'] = dict(type='BatchNormClassifier')
    cfg['train_dataloader']['dataset']['type'] = 'ParityShiftedDataset'
    cfg['train_dataloader']['sampler'] = dict(type='DefaultSampler', shuffle=False)
    cfg['train_cfg']['val_interval'] = VAL_INTERVAL
    cfg['custom_hooks'] = [dict(type='NormRecorder', label='before', priority=40),
                           dict(type=hook, priority=48),  # as in YOLOX's configs
                           dict(type='NormRecorder', label='after', priority=50)]
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    out: Dict[str, Any] = {h.label: h.records for h in runner.hooks if isinstance(h, NormRecorder)}
    out['hook'] = [type(h).__module__ + '.' + type(h).__name__ for h in runner.hooks
                   if 'SyncNorm' in type(h).__name__]
    out['loss'] = scalar_history(runner, 'train/loss')
    return out


def _two_ranks(root: str) -> Dict[str, Any]:
    return {name: _train(root, name) for name in RUNS}


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp('syncnorm')), timeout=400)


def _fp32_mean(records: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The stock hook's mean: fp32 sum over the ranks, divided by their number, cast back."""
    return {k: (sum(r[k].float() for r in records) / len(records)).to(records[0][k].dtype)
            for k in records[0]}


@pytest.mark.parametrize('run', list(RUNS))
def test_every_rank_gets_the_fp32_mean_of_the_ranks_running_statistics(ranks, run):
    expected = 'MmdetSyncNormHook' if run == 'ddp-stock' else 'mmfsdp.sync_norm.SyncNormHook'
    assert ranks[0][run]['hook'][0].endswith(expected), ranks[0][run]['hook']
    for i in range(VALIDATIONS):
        before = [rank[run]['before'][i] for rank in ranks]
        assert sorted(before[0]) == sorted(f'{m}.{b}' for m in ('embed.1', 'head.1') for b in (
            'running_mean', 'running_var', 'num_batches_tracked'))
        assert max_abs_diff(*[{k: v for k, v in b.items() if 'running' in k}
                              for b in before]) > 0.1  # the ranks' statistics part
        mean = _fp32_mean(before)
        for rank in ranks:
            assert max_abs_diff(rank[run]['after'][i], mean) == 0, (run, i)


@pytest.mark.parametrize('run', list(WRAPPERS))
def test_the_synced_statistics_and_the_training_equal_the_stock_hook_under_ddp(ranks, run):
    # bit-equal: this model trains bit-equal under the three wrappers (FSDP2 can part by a
    # rounding unit where one unit's output feeds several, docs/hooks-and-models.md), and
    # the mean is the stock hook's arithmetic on the same values
    for rank in ranks:
        reference = rank['ddp-stock']
        for after, stock in zip(rank[run]['after'], reference['after'], strict=True):
            assert max_abs_diff(after, stock) == 0, run
        assert max_abs_diff(dict(loss=torch.tensor(rank[run]['loss'])),
                            dict(loss=torch.tensor(reference['loss']))) == 0
