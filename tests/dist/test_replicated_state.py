"""Replicated state in a checkpoint is rank 0's, whether it is saved full or sharded.

BatchNorm's running statistics are buffers that every rank keeps for itself (as
under mmengine's DDP, ``broadcast_buffers=False``). A ``'full'`` checkpoint
holds rank 0's, as mmengine's stock checkpoint does; a ``'sharded'`` directory
must hold the same, and so must the averaged (EMA) buffers beside them, or one
training step saved in the two formats would be two different models.

One 2-rank process group trains a BatchNorm model under FSDP2 and FSDP1, saving
in each format, with ``EMAHook(update_buffers=True)``. The ranks see different
data (rank 0 the even samples, rank 1 the odd ones, shifted and scaled), so
their statistics differ. Each run is resumed on both ranks. This process
reads the full files and consolidates the sharded directories.
"""
import functools
import os

import pytest
import torch
from mmengine.registry import MODELS
from torch import nn

import contract_models  # noqa: F401  (registers ParityShiftedDataset)
from harness import max_abs_diff, run_distributed
from toy import FSDP1, FSDP2, IN_DIM, ToyClassifier, checkpointing_config

WRAPPERS = {'fsdp2': FSDP2, 'fsdp1': FSDP1}
TYPES = ('full', 'sharded')
RUNS = [f'{wrapper}-{kind}' for wrapper in WRAPPERS for kind in TYPES]
GLOBAL_BATCH, ITERS = 8, 4
#: The statistics of the two ranks differ by more than this in every run.
RANKS_APART = 0.1
#: The averaged buffers follow the trained ones closely enough to differ across ranks too.
EMA = dict(type='EMAHook', momentum=0.5, update_buffers=True)


@MODELS.register_module()
class TwoBatchNormClassifier(ToyClassifier):
    """``ToyClassifier`` with a ``BatchNorm1d`` on its inputs and one after its embedding."""

    def __init__(self, dim: int = 16, **kwargs) -> None:
        super().__init__(dim=dim, **kwargs)
        self.input_norm = nn.BatchNorm1d(IN_DIM)
        self.embed = nn.Sequential(nn.Linear(IN_DIM, dim), nn.BatchNorm1d(dim))

    def forward(self, inputs, data_samples=None, mode: str = 'tensor'):
        return super().forward(self.input_norm(inputs), data_samples, mode)


def _config(work_dir: str, wrapper: dict, **kwargs):
    cfg = checkpointing_config(work_dir, wrapper, 2, global_batch=GLOBAL_BATCH,
                               max_iters=ITERS, interval=ITERS, **kwargs)
    cfg.model = dict(type='TwoBatchNormClassifier')
    cfg.train_dataloader.dataset.type = 'ParityShiftedDataset'
    cfg.train_dataloader.sampler = dict(type='DefaultSampler', shuffle=False)
    cfg.custom_hooks = [dict(EMA)]
    return cfg


def _replicated(runner) -> dict:
    """This rank's live buffers and averaged (EMA) buffers, by the unwrapped names."""
    from mmfsdp.names import unwrapped_named_buffers
    (ema,) = [h for h in runner.hooks if type(h).__name__ == 'EMAHook']
    return dict(live={k: b.detach().clone() for k, b in unwrapped_named_buffers(runner.model)},
                ema={k: b.detach().clone() for k, b in ema.ema_model.module.named_buffers()})


def _ckpt(root: str, run: str) -> str:
    return os.path.join(root, run, f'iter_{ITERS}.pth')


def _two_ranks(root: str) -> dict:
    from mmfsdp import FSDPRunner
    out = {}
    for wrapper, cfg in WRAPPERS.items():
        for kind in TYPES:
            run = f'{wrapper}-{kind}'
            runner = FSDPRunner.from_cfg(_config(f'{root}/{run}', cfg, state_dict_type=kind))
            runner.train()
            out[run] = _replicated(runner)
            resume = _config(f'{root}/{run}-resumed', cfg, resume_from=_ckpt(root, run))
            resume.default_hooks.checkpoint = None
            resumed = FSDPRunner.from_cfg(resume)
            resumed.train()  # saved at the last iteration: loads, trains no further step
            assert resumed.iter == ITERS
            out[f'{run}/resumed'] = _replicated(resumed)
    return out


@pytest.fixture(scope='module')
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('replicated'))


@pytest.fixture(scope='module')
def ranks(root) -> list:
    return run_distributed(_two_ranks, 2, root, timeout=600)


@functools.cache
def _saved(root: str, run: str) -> dict:
    """The trained and the averaged buffers of a run's checkpoint, as a full file holds them."""
    from mmfsdp.checkpoint.safe_io import load_file
    from mmfsdp.consolidate import consolidate
    path = _ckpt(root, run)
    if os.path.isdir(path):
        checkpoint = consolidate(path, os.path.join(root, f'{run}-consolidated.pth'))
    else:
        checkpoint = load_file(path)
    # EMAHook's layout: the averaged model in state_dict, the trained one in ema_state_dict
    trained = {k[len('module.'):]: v for k, v in checkpoint['ema_state_dict'].items()
               if k.startswith('module.')}
    return dict(live=trained, ema=checkpoint['state_dict'])


def _apart(a: dict, b: dict) -> float:
    """The largest difference between two sets of running statistics."""
    return max_abs_diff(*({k: v for k, v in s.items() if 'running_' in k} for s in (a, b)))


def _equal(saved: dict, live: dict) -> None:
    assert live, 'no buffers to compare'
    for key, value in live.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize('run', RUNS)
def test_the_ranks_statistics_differ(ranks, run):
    for part in ('live', 'ema'):
        assert _apart(ranks[0][run][part], ranks[1][run][part]) > RANKS_APART, part


@pytest.mark.parametrize('run', RUNS)
def test_checkpoint_holds_rank0s_buffers(ranks, root, run):
    """The full file, and the consolidated directory, hold rank 0's buffers and averages."""
    saved = _saved(root, run)
    for part in ('live', 'ema'):
        _equal(saved[part], ranks[0][run][part])
        assert _apart(saved[part], ranks[1][run][part]) > RANKS_APART, part


@pytest.mark.parametrize('run', RUNS)
def test_resume_gives_every_rank_the_saved_buffers(ranks, root, run):
    """Every rank resumes with the saved buffers, which are rank 0's at the save."""
    saved = _saved(root, run)
    for rank in (0, 1):
        for part in ('live', 'ema'):
            _equal(saved[part], ranks[rank][f'{run}/resumed'][part])
            _equal(ranks[0][run][part], ranks[rank][f'{run}/resumed'][part])


def test_full_and_sharded_saves_of_one_step_are_one_model(ranks, root):
    """The same training, saved in the two formats: the same buffers (rank 0's)."""
    for wrapper in WRAPPERS:
        full, sharded = _saved(root, f'{wrapper}-full'), _saved(root, f'{wrapper}-sharded')
        for part in ('live', 'ema'):
            _equal(sharded[part], full[part])
