"""Resume restores everything, exactly, in the cases the basic resume tests do not cover.

One 2-rank process group runs, under FSDP1, FSDP2 and DDP and for both
checkpoint types:

- SGD without momentum (an optimizer with no state): uninterrupted, and
  resumed from iteration 3;
- AdamW with ``paramwise_cfg`` (several param groups, so ``base_param_settings``)
  and ``OneCycleLR``, saving a checkpoint before the first optimizer step:
  uninterrupted without that save, with it, resumed from it and from
  iteration 3 (FSDP2 only: the wrappers share the code paths above).

In this process (no process group: every checkpoint type works without one)
a run with every built-in mmengine scheduler, a ``dataset_meta`` holding numpy
arrays and an AMP loss scaler saves both types; each file loads with plain
``torch.load(weights_only=True)`` and resumes exactly.
"""
import functools
import os
import warnings
from typing import Optional

import numpy as np
import pytest
import torch
from mmengine.hooks import Hook
from mmengine.registry import DATASETS, HOOKS, PARAM_SCHEDULERS
from mmengine.runner import Runner

from harness import max_abs_diff, run_distributed
from mmfsdp import FSDPRunner
from mmfsdp.checkpoint import META_FILE
from toy import FSDP1, FSDP2, WRAPPERS, ToyDataset, checkpointing_config, runner_config

TYPES = ('full', 'sharded')
GLOBAL_BATCH, HALF, TOTAL = 8, 3, 6
SGD = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0))
ADAMW = dict(optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.05),
             paramwise_cfg=dict(norm_decay_mult=0.0, custom_keys={'head': dict(lr_mult=0.1)}))
ONE_CYCLE = [dict(type='OneCycleLR', eta_max=2e-2, total_steps=TOTAL, by_epoch=False)]


@HOOKS.register_module()
class ListBestCheckpointsHook(Hook):
    """Records, at each save, whether it saves a best checkpoint and which exist (rank 0)."""

    def __init__(self) -> None:
        self.seen = []

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        is_best = 'optimizer' not in checkpoint and 'optimizer_extras' not in checkpoint
        self.seen.append((is_best, sorted(n for n in os.listdir(runner.work_dir)
                                          if n.startswith('best_'))))


@HOOKS.register_module()
class SaveBeforeFirstStepHook(Hook):
    """Saves ``iter_0.pth`` before the first iteration (so before the first optimizer step)."""

    def __init__(self, state_dict_type: str) -> None:
        self.state_dict_type = state_dict_type

    def before_train(self, runner) -> None:
        runner.save_checkpoint(runner.work_dir, 'iter_0.pth', meta=dict(epoch=0, iter=0),
                               by_epoch=False, state_dict_type=self.state_dict_type)


#: Saves at iteration ``HALF`` of ``TOTAL``; the global batch is the same at every world size.
_config = functools.partial(checkpointing_config, global_batch=GLOBAL_BATCH, max_iters=TOTAL,
                            interval=HALF)


def _train(work_dir: str, wrapper, world_size: int, optim_wrapper: dict,
           resume_before_train: Optional[str] = None, **kwargs) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    runner = FSDPRunner.from_cfg(_config(work_dir, wrapper, world_size, optim_wrapper,
                                         **kwargs))
    if resume_before_train is not None:  # as mmengine's own tests call Runner.resume
        runner.resume(resume_before_train)
    runner.train()
    model, optimizer = gather_full_state(runner.model, runner.optim_wrapper)
    return dict(model={k: v.clone() for k, v in model.items()}, optimizer=optimizer['state'],
                lr=runner.optim_wrapper.get_lr(), iter=runner.iter)


def _two_ranks(root: str) -> dict:
    out = {}
    for wrapper in WRAPPERS:
        for kind in TYPES:
            run = f'sgd/{wrapper}-{kind}'
            out[run] = _train(f'{root}/{run}', WRAPPERS[wrapper], 2, SGD, state_dict_type=kind)
            out[f'{run}/resumed'] = _train(f'{root}/{run}-resumed', WRAPPERS[wrapper], 2, SGD,
                                           resume_from=f'{root}/{run}/iter_{HALF}.pth')
    out['adamw/plain'] = _train(f'{root}/adamw-plain', FSDP2, 2, ADAMW,
                                param_scheduler=ONE_CYCLE)
    for kind in TYPES:
        run = f'adamw/{kind}'
        out[run] = _train(f'{root}/{run}', FSDP2, 2, ADAMW, param_scheduler=ONE_CYCLE,
                          state_dict_type=kind,
                          custom_hooks=[dict(type='SaveBeforeFirstStepHook',
                                             state_dict_type=kind)])
        for at in (0, HALF):
            out[f'{run}/resumed-{at}'] = _train(
                f'{root}/{run}-resumed-{at}', FSDP2, 2, ADAMW, param_scheduler=ONE_CYCLE,
                resume_from=f'{root}/{run}/iter_{at}.pth')
        out[f'{run}/resume-called'] = _train(
            f'{root}/{run}-resume-called', FSDP2, 2, ADAMW, param_scheduler=ONE_CYCLE,
            resume_before_train=f'{root}/{run}/iter_{HALF}.pth')
    for kind in TYPES:
        out[f'best/{kind}'] = _save_best(f'{root}/best-{kind}', kind)
    return out if torch.distributed.get_rank() == 0 else None


def _save_best(work_dir: str, kind: str) -> dict:
    """Validate every 2 iterations, keep the best by nll, publish last and best."""
    cfg = _config(work_dir, FSDP2, 2, ADAMW, custom_hooks=[dict(type='ListBestCheckpointsHook')])
    cfg.merge_from_dict(runner_config('best', work_dir, batch_size=4, val=True))
    cfg.train_cfg = dict(by_epoch=False, max_iters=TOTAL, val_interval=2)
    cfg.default_hooks.checkpoint = dict(
        type='CheckpointHook', interval=2, by_epoch=False, state_dict_type=kind,
        save_best='nll', rule='less', published_keys=['meta', 'state_dict'])
    runner = FSDPRunner.from_cfg(cfg)
    runner.train()
    from mmfsdp.checkpoint.state import gather_full_state
    listing = [h for h in runner.hooks if type(h).__name__ == 'ListBestCheckpointsHook'][0]
    return dict(seen=listing.seen, files=sorted(os.listdir(work_dir)),
                best=runner.message_hub.get_info('best_ckpt'),
                model={k: v.clone() for k, v in gather_full_state(runner.model, None)[0].items()})


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp('resume-cases'))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return dict(run_distributed(_two_ranks, 2, root, timeout=600)[0], root=root)


def _assert_equal_training(got: dict, expected: dict) -> None:
    assert got['iter'] == expected['iter'] == TOTAL
    assert got['lr'] == expected['lr']  # lr and base_lr of every group
    model_diff = max_abs_diff(got['model'], expected['model'])
    optim_diff = max_abs_diff(got['optimizer'], expected['optimizer'])
    print(f'max abs diff: weights {model_diff:.1e}, optimizer state {optim_diff:.1e}')
    assert model_diff == 0 and optim_diff == 0


@pytest.mark.parametrize('wrapper', WRAPPERS)
@pytest.mark.parametrize('kind', TYPES)
def test_stateless_sgd_resumes_exactly(runs, wrapper, kind):
    run = f'sgd/{wrapper}-{kind}'
    assert runs[run]['optimizer'] == {}
    _assert_equal_training(runs[f'{run}/resumed'], runs[run])


@pytest.mark.parametrize('kind', TYPES)
def test_save_before_first_step_does_not_change_training(runs, kind):
    _assert_equal_training(runs[f'adamw/{kind}'], runs['adamw/plain'])


@pytest.mark.parametrize('kind', TYPES)
@pytest.mark.parametrize('at', [0, HALF])
def test_paramwise_one_cycle_adamw_resumes_exactly(runs, kind, at):
    assert 'base_lr' in runs['adamw/plain']['lr']
    _assert_equal_training(runs[f'adamw/{kind}/resumed-{at}'], runs['adamw/plain'])


def test_resume_called_before_train_trains_as_the_stock_runner(runs, tmp_path):
    """``runner.resume(path)`` then ``train()``, as mmengine's own tests call it.

    On 2 ranks (FSDP2) the resumed optimizer state follows the parameters into
    their shards. The stock Runner, on one process, is the reference: its
    ``train()`` initialises the weights again after ``resume()`` (``init_weights``
    had not run yet) and keeps the resumed optimizer state and iteration.
    """
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        runner = Runner.from_cfg(_config(str(tmp_path / 'stock'), None, 1, ADAMW,
                                         param_scheduler=ONE_CYCLE, default_hooks=dict(
                                             logger=dict(type='LoggerHook', interval=1))))
        runner.resume(f"{runs['root']}/adamw/full/iter_{HALF}.pth")
        runner.train()
    expected = runner.optim_wrapper.optimizer.state_dict()['state']
    for kind in TYPES:
        got = runs[f'adamw/{kind}/resume-called']
        assert got['iter'] == runner.iter == TOTAL and got['lr'] == runner.optim_wrapper.get_lr()
        assert sorted(int(s['step']) for s in got['optimizer'].values()) == sorted(
            int(s['step']) for s in expected.values()) == [TOTAL] * len(expected)
        assert max_abs_diff(got['model'], runner.model.state_dict()) <= 2e-5


@pytest.mark.parametrize('kind', TYPES)
def test_save_best_honours_state_dict_type_and_writes_before_deleting(runs, kind):
    got = runs[f'best/{kind}']
    bests = [n for n in got['files'] if n.startswith('best_nll_iter_') and '-' not in n]
    assert bests == [os.path.basename(got['best'])]  # one best, the latest
    assert os.path.isdir(got['best']) == (kind == 'sharded')
    # While each later best was being written, the previous one still existed.
    existing = [listing for is_best, listing in got['seen'] if is_best]
    assert len(existing) >= 2, 'the test needs two improvements of the score'
    assert existing[0] == [] and all(existing[1:]), existing


@pytest.mark.parametrize('kind', TYPES)
def test_published_keys_publish_both_formats(runs, kind):
    got = runs[f'best/{kind}']
    work_dir = os.path.dirname(got['best'])
    best_name = os.path.splitext(os.path.basename(got['best']))[0]
    for stem in (f'iter_{TOTAL}', best_name):
        published = [n for n in got['files'] if n.startswith(f'{stem}-')]
        assert len(published) == 1, got['files']
        checkpoint = torch.load(os.path.join(work_dir, published[0]), weights_only=True)
        assert sorted(checkpoint) == ['meta', 'state_dict']
        assert published[0].endswith('.pth') and len(published[0]) == len(stem) + 13
    last = [n for n in got['files'] if n.startswith(f'iter_{TOTAL}-')][0]
    state = torch.load(os.path.join(work_dir, last), weights_only=True)['state_dict']
    assert max_abs_diff(state, got['model']) == 0


# ---- every scheduler, numpy dataset_meta, AMP scaler: in this process ----

METAINFO = dict(classes=('cat', 'dog', 'bird'), palette=np.array([[0, 0, 0], [255, 0, 0],
                                                                  [0, 255, 0]], np.uint8),
                sigmas=np.array([0.026, 0.025, 0.035], np.float32), flip_pairs=[[0, 1]],
                scale=np.float64(1.5))


@DATASETS.register_module()
class ToyDatasetWithMeta(ToyDataset):
    """``ToyDataset`` with a ``metainfo`` such as mmpose / mmseg datasets carry."""

    @property
    def metainfo(self) -> dict:
        return dict(METAINFO)


def _every_scheduler() -> list:
    """One config per built-in mmengine parameter scheduler, all stepping together."""
    common = dict(by_epoch=False, begin=0, end=TOTAL)
    per_kind = dict(
        Constant=dict(factor=0.5), CosineAnnealing=dict(T_max=TOTAL), CosineRestart=dict(
            periods=[2, 4], restart_weights=[1, 0.5], eta_min=0.0), Exponential=dict(gamma=0.9),
        Linear=dict(start_factor=0.5), MultiStep=dict(milestones=[2, 4]),
        Poly=dict(power=2.0), Step=dict(step_size=2),
        ReduceOnPlateau=dict(monitor='loss', by_epoch=True))
    schedulers = []
    for kind, args in per_kind.items():
        schedulers += [dict(type=f'{kind}LR', **dict(common, **args)),
                       dict(type=f'{kind}Momentum', **dict(common, **args)),
                       dict(type=f'{kind}ParamScheduler', param_name='weight_decay',
                            **dict(common, **args))]
    schedulers += [dict(type='OneCycleLR', eta_max=2e-2, total_steps=TOTAL, by_epoch=False),
                   dict(type='OneCycleParamScheduler', param_name='lr', eta_max=1e-2,
                        total_steps=TOTAL, by_epoch=False)]
    return schedulers


def test_every_builtin_scheduler_is_covered():
    assert sorted(s['type'] for s in _every_scheduler()) == sorted(PARAM_SCHEDULERS.module_dict)


@pytest.fixture(scope='module')
def one_process(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp('round-trip'))
    amp = dict(type='mmfsdp.AmpOptimWrapper', dtype='float16',
               optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.05))
    extra = dict(param_scheduler=_every_scheduler())
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for kind in TYPES:
            cfg = _config(f'{root}/{kind}', FSDP1, 1, amp, state_dict_type=kind, **extra)
            cfg.train_dataloader.dataset.type = 'ToyDatasetWithMeta'
            runner = FSDPRunner.from_cfg(cfg)
            runner.train()
            out[kind] = _state(runner)
            cfg = _config(f'{root}/{kind}-resumed', FSDP1, 1, amp,
                          resume_from=f'{root}/{kind}/iter_{HALF}.pth', **extra)
            cfg.train_dataloader.dataset.type = 'ToyDatasetWithMeta'
            resumed = FSDPRunner.from_cfg(cfg)
            out[f'{kind}/logged'] = []
            resumed.logger.warning = out[f'{kind}/logged'].append
            resumed.train()
            out[f'{kind}/resumed'] = _state(resumed)
    out['root'] = root
    return out


def _state(runner) -> dict:
    return dict(model={k: v.clone() for k, v in runner.model.state_dict().items()},
                optimizer=runner.optim_wrapper.optimizer.state_dict()['state'],
                lr=runner.optim_wrapper.get_lr(),
                scaler=runner.optim_wrapper.loss_scaler.state_dict(),
                schedulers=[{k: v for k, v in s.state_dict().items() if not callable(v)}
                            for s in runner.param_schedulers], iter=runner.iter)


@pytest.mark.parametrize('kind', TYPES)
def test_everything_we_write_loads_with_weights_only(one_process, kind):
    path = f"{one_process['root']}/{kind}/iter_{HALF}.pth"
    checkpoint = torch.load(path if kind == 'full' else f'{path}/{META_FILE}',
                            weights_only=True)
    assert len(checkpoint['param_schedulers']) == len(_every_scheduler())
    assert 'loss_scaler' in (checkpoint['optimizer'] if kind == 'full'
                             else checkpoint['optimizer_extras'])
    assert 'palette' in str(checkpoint['meta']['dataset_meta'])


@pytest.mark.parametrize('kind', TYPES)
def test_resume_restores_schedulers_dataset_meta_and_scaler(one_process, kind):
    got, expected = one_process[f'{kind}/resumed'], one_process[kind]
    assert not [m for m in one_process[f'{kind}/logged'] if 'metainfo' in m]
    assert got['schedulers'] == expected['schedulers']
    assert got['scaler'] == expected['scaler']
    _assert_equal_training(got, expected)


@pytest.mark.parametrize('kind', TYPES)
def test_dataset_meta_comes_back_as_numpy(one_process, tmp_path, kind):
    runner = FSDPRunner.from_cfg(_config(str(tmp_path / 'load'), FSDP1, 1, SGD))
    checkpoint = runner.load_checkpoint(f"{one_process['root']}/{kind}/iter_{HALF}.pth")
    meta = checkpoint['meta']['dataset_meta']
    assert meta['palette'].dtype == np.uint8 and meta['palette'].shape == (3, 3)
    np.testing.assert_array_equal(meta['sigmas'], METAINFO['sigmas'])
    assert meta['classes'] == METAINFO['classes'] and meta['scale'] == 1.5


def test_optimizer_state_for_another_parameter_count_is_refused():
    from mmengine.optim import OptimWrapper

    from mmfsdp.checkpoint.state import load_full_optimizer_state
    from toy import ToyClassifier

    def stepped(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 6), torch.zeros(4, dtype=torch.long), mode='loss')['loss'].backward()
        optimizer.step()
        return optimizer

    other = stepped(ToyClassifier(depth=2)).state_dict()  # torch's integer-keyed format
    model = ToyClassifier(depth=3)
    wrapper = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(ValueError, match=r'param groups of \[18\] parameters, this optimizer '
                                         r'has \[24\]'):
        load_full_optimizer_state(model, wrapper, other)
