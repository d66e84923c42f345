"""Drop-in where mmengine's own code reads checkpoints and resumes.

In this process (no process group), each check set beside mmengine's stock
Runner on the same config:

- a full checkpoint written by ``FSDPRunner`` and read with plain
  ``torch.load(weights_only=True)`` (no allow-list) gives mmengine's stock
  readers (``MessageHub.load_state_dict``, ``meta``, the stock
  ``Runner.resume``) the values the stock Runner's own checkpoint gives them;
- ``FSDPRunner.resume(path)`` called before ``train()`` builds the optim
  wrapper from its config and loads its state, as ``Runner.resume`` does, with
  and without a parameter scheduler.
"""
import logging
import os
import warnings

import numpy as np
import pytest
import torch
from mmengine.config import Config
from mmengine.logging import MessageHub, MMLogger
from mmengine.registry import DATASETS
from mmengine.runner import Runner

from harness import max_abs_diff
from mmfsdp import FSDPRunner
from toy import DDP, ToyDataset, runner_config

SAVE_AT, TOTAL = 4, 8
ADAM = dict(optimizer=dict(type='Adam', lr=1e-2))
SCHEDULER = [dict(type='LinearLR', start_factor=0.5, by_epoch=False, begin=0, end=TOTAL)]
METAINFO = dict(classes=('cat', 'dog'), palette=np.array([[0, 0, 0], [255, 0, 0]], np.uint8),
                sigmas=np.array([0.026, 0.035], np.float32), scale=np.float64(1.5),
                count=np.int64(3))


@DATASETS.register_module()
class ToyDatasetWithNumpyMeta(ToyDataset):
    """``ToyDataset`` whose ``metainfo`` holds numpy arrays and scalars (as mmpose's)."""

    @property
    def metainfo(self) -> dict:
        return dict(METAINFO)


def _config(work_dir: str, runner_type, max_iters: int, scheduler: bool) -> Config:
    cfg = runner_config(os.path.basename(work_dir), work_dir, batch_size=8, max_iters=max_iters,
                        launcher='none', wrapper=DDP if runner_type is FSDPRunner else None,
                        optim_wrapper=ADAM)
    cfg['train_dataloader']['dataset']['type'] = 'ToyDatasetWithNumpyMeta'
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=SAVE_AT,
                                              by_epoch=False, max_keep_ckpts=2)
    if scheduler:
        cfg['param_scheduler'] = SCHEDULER
    return Config(cfg)


@pytest.fixture(scope='module')
def saved(tmp_path_factory) -> dict:
    """``iter_4.pth`` of the stock Runner and of FSDPRunner, with and without a scheduler."""
    root = tmp_path_factory.mktemp('stock-readers')
    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for runner_type in (Runner, FSDPRunner):
            for scheduler in (False, True):
                work_dir = str(root / f'{runner_type.__name__}-{scheduler}')
                runner_type.from_cfg(_config(work_dir, runner_type, SAVE_AT, scheduler)).train()
                paths[runner_type.__name__, scheduler] = f'{work_dir}/iter_{SAVE_AT}.pth'
    return dict(root=root, paths=paths)


def _stock_load(path: str) -> dict:
    return torch.load(path, weights_only=False)  # mmengine's own files pickle numpy, HistoryBuffer


def _comparable(runtime_info: dict) -> dict:
    """Runtime info without what differs between two runs by construction: the config
    text and experiment name (runner type, names) and the work dir in ``last_ckpt`` (its
    file name stays)."""
    info = {k: v for k, v in runtime_info.items() if k not in ('cfg', 'experiment_name')}
    if 'last_ckpt' in info:
        info['last_ckpt'] = os.path.basename(info['last_ckpt'])
    return info


def _assert_same_values(got, expected, where: str = '') -> None:
    """``got`` (read with weights_only) holds ``expected``'s values; a numpy array may be
    a tensor of its dtype and shape, a numpy scalar the Python number."""
    if isinstance(expected, np.ndarray):
        array = np.asarray(got)
        assert array.dtype == expected.dtype and array.shape == expected.shape, where
        np.testing.assert_array_equal(array, expected, err_msg=where)
    elif isinstance(expected, dict):
        assert sorted(got) == sorted(expected), where
        for key in expected:
            _assert_same_values(got[key], expected[key], f'{where}[{key!r}]')
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            _assert_same_values(a, b, f'{where}[{i}]')
    else:
        assert got == expected and not isinstance(got, (np.generic, dict)), where


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _hub_loaded_by_mmengine(state: dict, name: str) -> tuple:
    """A fresh stock MessageHub after ``load_state_dict(state)``; what it logged."""
    hub = MessageHub(name)
    records = _Records()
    logger = MMLogger.get_current_instance()
    logger.addHandler(records)
    try:
        hub.load_state_dict(state)
    finally:
        logger.removeHandler(records)
    return hub, records.messages


def test_weights_only_file_gives_stock_message_hub_its_runtime_info(saved):
    ours = torch.load(saved['paths']['FSDPRunner', True], weights_only=True)  # no allow-list
    stock = _stock_load(saved['paths']['Runner', True])
    got, logged = _hub_loaded_by_mmengine(ours['message_hub'], 'ours-hub')
    expected, _ = _hub_loaded_by_mmengine(stock['message_hub'], 'stock-hub')
    assert logged == []  # nothing skipped, nothing "not defined in message_hub"
    own, theirs = _comparable(got.runtime_info), _comparable(expected.runtime_info)
    assert own['keep_ckpt_ids'] == [SAVE_AT] and own['iter'] == SAVE_AT - 1
    _assert_same_values(own, theirs)  # dataset_meta included
    # the logging windows are the one thing a weights_only file cannot hand to a stock
    # reader (MessageHub takes them only as HistoryBuffer objects): left out, not mangled
    assert dict(got.log_scalars) == {} and 'train/loss' in expected.log_scalars


def test_weights_only_file_gives_stock_readers_the_meta_values(saved):
    ours = torch.load(saved['paths']['FSDPRunner', True], weights_only=True)['meta']
    stock = _stock_load(saved['paths']['Runner', True])['meta']
    assert (ours['seed'], ours['epoch'], ours['iter']) == (
        stock['seed'], stock['epoch'], stock['iter'])
    got, expected = ours['dataset_meta'], stock['dataset_meta']
    _assert_same_values(got, expected)
    assert isinstance(got['palette'], torch.Tensor)  # np.asarray of it is the array again
    assert got['scale'] == expected['scale'] == 1.5 and type(got['scale']) is float
    assert got['count'] == expected['count'] == 3 and type(got['count']) is int
    assert got['classes'] == expected['classes']


def test_stock_runner_resumes_from_our_file_as_from_its_own(saved, monkeypatch):
    """The stock Runner, weights_only loading (torch's default), resumes from our file."""

    def resumed(path: str, name: str) -> dict:
        runner = Runner.from_cfg(_config(str(saved['root'] / name), Runner, TOTAL, True))
        runner.resume(path)
        return dict(iter=runner.iter, seed=runner.seed,
                    info=_comparable(runner.message_hub.runtime_info),
                    optimizer=runner.optim_wrapper.optimizer.state_dict()['state'],
                    lr=runner.optim_wrapper.get_lr(),
                    scheduler=runner.param_schedulers[0].state_dict())

    got = resumed(saved['paths']['FSDPRunner', True], 'stock-from-ours')
    with monkeypatch.context() as env:
        env.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')  # the stock file needs it
        expected = resumed(saved['paths']['Runner', True], 'stock-from-stock')
    assert (got['iter'], got['seed'], got['lr']) == (expected['iter'], expected['seed'],
                                                     expected['lr'])
    _assert_same_values(got['info'], expected['info'])
    assert got['scheduler'] == expected['scheduler']
    assert max_abs_diff(got['optimizer'], expected['optimizer']) == 0


def _resumed_before_train(path: str, work_dir: str, runner_type, scheduler: bool) -> dict:
    runner = runner_type.from_cfg(_config(work_dir, runner_type, TOTAL, scheduler))
    runner.resume(path)
    steps = [int(s['step']) for s in runner.optim_wrapper.optimizer.state.values()]
    lr = runner.optim_wrapper.get_lr()
    runner.train()
    return dict(steps_after_resume=steps, lr_after_resume=lr,
                steps=[int(s['step']) for s in runner.optim_wrapper.optimizer.state.values()],
                model={k: v.clone() for k, v in runner.model.state_dict().items()})


@pytest.mark.parametrize('scheduler', [False, True], ids=['no-scheduler', 'scheduler'])
def test_resume_before_train_builds_the_optim_wrapper_as_stock_runner(saved, monkeypatch,
                                                                      scheduler):
    root = saved['root']
    got = _resumed_before_train(saved['paths']['FSDPRunner', scheduler],
                                str(root / f'ours-resumed-{scheduler}'), FSDPRunner, scheduler)
    with monkeypatch.context() as env:
        env.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
        expected = _resumed_before_train(saved['paths']['Runner', scheduler],
                                         str(root / f'stock-resumed-{scheduler}'), Runner,
                                         scheduler)
    assert expected['steps_after_resume'][0] == SAVE_AT and expected['steps'][0] == TOTAL
    assert got['steps_after_resume'] == expected['steps_after_resume']
    assert got['lr_after_resume'] == expected['lr_after_resume']
    assert got['steps'] == expected['steps']
    assert max_abs_diff(got['model'], expected['model']) <= 1e-6
