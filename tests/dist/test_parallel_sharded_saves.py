"""Sharded saves write in parallel: every rank writes a share of the replicated entries.

Parameters and optimizer state that several ranks hold (all of them under DDP,
each shard's replicas in an HSDP mesh) have the same values on those ranks;
DCP balances their writes over the ranks. Buffers differ across ranks (each
rank's BatchNorm statistics come from its own batches) and are rank 0's, as
in a full checkpoint. DDP on 2 ranks and FSDP2 in a 2 x 2 HSDP mesh on 4 ranks
save a sharded checkpoint of a BatchNorm model; the bytes in each rank's
``__<rank>_0.distcp`` and the saved statistics are compared with rank 0's.
"""
import glob
import os

import pytest
import torch
from mmengine.registry import MODELS
from torch import nn

import contract_models  # noqa: F401  (registers ParityShiftedDataset)
from harness import run_distributed
from toy import DDP, FSDP2, IN_DIM, ToyClassifier, checkpointing_config

ITERS = 2
HSDP = dict(FSDP2, mesh=dict(replicate=2, shard=2))
#: Each rank's share of a checkpoint's bytes is at least this fraction of an even split.
FAIR = 0.5


@MODELS.register_module()
class InputNormToy(ToyClassifier):
    """``ToyClassifier`` behind a ``BatchNorm1d``: buffers that differ across ranks."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.input_norm = nn.BatchNorm1d(IN_DIM)

    def forward(self, inputs, data_samples=None, mode: str = 'tensor'):
        return super().forward(self.input_norm(inputs), data_samples, mode)


def _save(root: str, name: str, wrapper: dict, world_size: int) -> dict:
    """Train ``ITERS`` steps and save sharded; this rank's BatchNorm statistics."""
    from mmfsdp import FSDPRunner
    cfg = checkpointing_config(f'{root}/{name}', wrapper, world_size,
                               global_batch=8, max_iters=ITERS, interval=ITERS,
                               state_dict_type='sharded')
    cfg.model = dict(type='InputNormToy')
    cfg.train_dataloader.dataset.type = 'ParityShiftedDataset'
    cfg.train_dataloader.sampler = dict(type='DefaultSampler', shuffle=False)
    runner = FSDPRunner.from_cfg(cfg)
    runner.train()
    norm = runner.model.module.input_norm if hasattr(runner.model, 'module') else \
        runner.model.input_norm
    return {k: v.detach().clone() for k, v in norm.state_dict().items()}


def _ddp(root: str) -> dict:
    return _save(root, 'ddp', DDP, 2)


def _hsdp(root: str) -> dict:
    return _save(root, 'hsdp', HSDP, 4)


def _bytes_per_rank(root: str, name: str, world_size: int) -> list:
    path = os.path.join(root, name, f'iter_{ITERS}.pth')
    files = sorted(glob.glob(os.path.join(path, '__*_0.distcp')))
    assert len(files) == world_size, files
    return [os.path.getsize(os.path.join(path, f'__{rank}_0.distcp'))
            for rank in range(world_size)]


def _saved_statistics(root: str, name: str) -> dict:
    from mmfsdp.consolidate import consolidate
    checkpoint = consolidate(os.path.join(root, name, f'iter_{ITERS}.pth'),
                             os.path.join(root, f'{name}.pth'))
    prefix = 'input_norm.'
    return {k[len(prefix):]: v for k, v in checkpoint['state_dict'].items()
            if k.startswith(prefix)}


@pytest.mark.parametrize('name, fn, world_size', [('ddp', _ddp, 2), ('hsdp', _hsdp, 4)])
def test_every_rank_writes_its_share_and_buffers_are_rank0s(tmp_path, name, fn, world_size):
    root = str(tmp_path)
    ranks = run_distributed(fn, world_size, root, timeout=300)
    written = _bytes_per_rank(root, name, world_size)
    print(f'{name}: bytes per rank {written}')
    assert min(written) >= FAIR * sum(written) / world_size, written
    saved = _saved_statistics(root, name)
    assert torch.equal(saved['running_mean'], ranks[0]['running_mean'])
    assert torch.equal(saved['running_var'], ranks[0]['running_var'])
    others = [r for r in ranks[1:] if not torch.equal(r['running_mean'], ranks[0]['running_mean'])]
    assert others, 'the ranks should have seen different batches'
