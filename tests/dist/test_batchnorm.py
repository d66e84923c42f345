"""BatchNorm models under every wrapper: buffers averaged on request, SyncBN configs on a CPU.

BatchNorm's running statistics are buffers that every rank keeps for itself (as
under mmengine's DDP, ``broadcast_buffers=False``). Here the two ranks see
different data (rank 0 the even samples, rank 1 the odd ones, scaled and
shifted), so their statistics part.

- mmengine's ``SyncBuffersHook`` must replace every rank's buffers with their
  mean under DDP, FSDP1 and FSDP2. Two recording hooks, one running before it
  and one after, keep each rank's buffers around every place it acts (before
  each validation; after the training epoch, which an iteration-based loop ends
  once); this process computes the mean from the "before" values. The same
  training without the hook shows that the ranks' statistics differ.
- A model whose backbone and head use ``nn.SyncBatchNorm`` (OpenMMLab's
  ``norm_cfg=dict(type='SyncBN')``) trains on 2 CPU ranks under each wrapper,
  meta init included (equal to eager construction): ``FSDPRunner`` converts it
  to BatchNorm where there is no accelerator and logs, once, which modules it
  converted; one process too. ``sync_bn='torch'`` is not applied there, and says so.
- Built in Python without ``env_cfg``, ``FSDPRunner`` gets mmengine's default
  ``dist_cfg=dict(backend='nccl')``: it starts (gloo on the CPU), while a
  config that says ``backend='nccl'`` is still refused.
"""
import copy
import glob
import os
from typing import Any, Dict, List, Optional

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS, MODELS
from mmengine.runner import Runner
from torch import nn

import contract_models  # noqa: F401  (registers ParityShiftedDataset)
from harness import max_abs_diff, raised, run_distributed, scalar_history
from mmfsdp.runner import is_mmengine_default_env
from toy import (
    FSDP1,
    FSDP2,
    IN_DIM,
    NUM_CLASSES,
    WRAPPERS,
    ToyClassifier,
    runner_config,
)

#: The statistics of the two ranks differ by more than this before every sync.
RANKS_APART = 0.1
#: Norm layers by the registry names OpenMMLab configs use in ``norm_cfg``.
NORMS = {'BN1d': nn.BatchNorm1d, 'SyncBN': nn.SyncBatchNorm}
#: The modules of ``NormedClassifier`` that hold a norm.
NORM_MODULES = ('embed.1', 'head.1')
#: Validation after iterations 2, 4 and 5 (the last), then the end of the epoch.
ITERS, VAL_INTERVAL = 5, 2
VAL_EVENTS = ['before_val_epoch'] * 3
#: The runs of each wrapper: the hook acts before each validation (at the end of
#: the epoch the buffers are already synced) or, without validation, at the end.
SYNC_RUNS = {'plain': dict(sync=False), 'sync-val': dict(sync=True),
             'sync-train': dict(sync=True, val=False)}


@MODELS.register_module()
class NormedClassifier(ToyClassifier):
    """``ToyClassifier`` with a norm after its embedding (backbone) and inside its head.

    ``norm_cfg=dict(type='SyncBN')`` builds ``nn.SyncBatchNorm``, as OpenMMLab's
    configs do; ``'BN1d'`` plain BatchNorm. ``random_init=False`` initialises
    without random draws, so that meta init must equal eager construction.
    """

    def __init__(self, dim: int = 16, norm_cfg: Optional[dict] = None, random_init: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(dim=dim, **kwargs)
        self.random_init = random_init
        norm = NORMS[(norm_cfg or dict(type='BN1d'))['type']]
        self.embed = nn.Sequential(nn.Linear(IN_DIM, dim), norm(dim))
        self.head = nn.Sequential(nn.Linear(dim, dim), norm(dim), nn.ReLU(),
                                  nn.Linear(dim, NUM_CLASSES))

    def init_weights(self) -> None:
        if self.random_init:
            return super().init_weights()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.constant_(module.weight, 1 / module.weight.shape[1])
                nn.init.constant_(module.bias, 0.01 * module.weight.shape[0])


@HOOKS.register_module()
class BufferRecorder(Hook):
    """Keeps this rank's buffers at every place ``SyncBuffersHook`` acts.

    Registered twice: with a higher priority it runs before ``SyncBuffersHook``,
    with a lower one after it.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.records: List[Dict[str, Any]] = []

    def _record(self, runner, event: str) -> None:
        from mmfsdp.names import unwrapped_named_buffers
        self.records.append(dict(event=event, buffers={
            name: b.detach().clone() for name, b in unwrapped_named_buffers(runner.model)}))

    def before_val_epoch(self, runner) -> None:
        self._record(runner, 'before_val_epoch')

    def after_train_epoch(self, runner) -> None:
        self._record(runner, 'after_train_epoch')


def _config(root: str, name: str, wrapper: dict, *, norm: str = 'BN1d', sync: bool = False,
            val: bool = True, **extra: Any) -> dict:
    cfg = runner_config(name, os.path.join(root, name), wrapper=wrapper, batch_size=4,
                        max_iters=ITERS, val=val)
    # SyncBN runs are compared with meta init: no random draws in init_weights
    cfg['model'] = dict(type='NormedClassifier', norm_cfg=dict(type=norm),
                        random_init=norm != 'SyncBN')
    cfg['train_dataloader']['dataset']['type'] = 'ParityShiftedDataset'
    cfg['train_dataloader']['sampler'] = dict(type='DefaultSampler', shuffle=False)
    cfg['train_cfg']['val_interval'] = VAL_INTERVAL
    hooks = [dict(type='BufferRecorder', label='before', priority='ABOVE_NORMAL'),
             dict(type='BufferRecorder', label='after', priority='BELOW_NORMAL')]
    if sync:
        hooks.append(dict(type='SyncBuffersHook'))
    cfg['custom_hooks'] = hooks
    cfg.update(extra)
    return cfg


def _records(runner) -> Dict[str, list]:
    return {h.label: h.records for h in runner.hooks if isinstance(h, BufferRecorder)}


def _log_text(runner) -> str:
    return ''.join(open(f).read() for f in glob.glob(os.path.join(runner.log_dir, '*.log')))


def _python_runner(root: str, name: str, **env: Any):
    """``FSDPRunner(...)`` built in Python, without ``cfg`` (mmfsdp's default DDP wrapper)."""
    from mmfsdp import FSDPRunner
    cfg = _config(root, name, WRAPPERS['ddp'], val=False)
    keys = ('model', 'work_dir', 'train_dataloader', 'train_cfg', 'optim_wrapper', 'launcher',
            'default_hooks', 'randomness', 'log_level', 'experiment_name')
    return FSDPRunner(**{k: cfg[k] for k in keys}, **env)


def _start_up(root: str) -> Dict[str, Any]:
    """Refusals of a real ``backend='nccl'`` (no group starts), then a start with mmengine's."""
    import torch.distributed as dist
    from mmengine.config import Config

    from mmfsdp import FSDPRunner
    nccl = dict(dist_cfg=dict(backend='nccl'))
    out: Dict[str, Any] = dict(
        python_nccl=raised(lambda: _python_runner(root, 'python-nccl', env_cfg=nccl)),
        config_nccl=raised(lambda: FSDPRunner.from_cfg(Config(dict(
            _config(root, 'config-nccl', WRAPPERS['ddp']), env_cfg=nccl)))),
        started_before=dist.is_initialized())
    runner = _python_runner(root, 'python-default')  # no env_cfg: mmengine's default
    out['backend'] = dist.get_backend()
    runner.train()
    out['loss'] = scalar_history(runner, 'train/loss')
    return out


def _two_ranks(root: str) -> Dict[str, Any]:
    from mmengine.config import Config

    from mmfsdp import FSDPRunner
    out: Dict[str, Any] = dict(start_up=_start_up(root))  # first: it starts the group
    for wrapper, wrapper_cfg in WRAPPERS.items():
        for run, options in SYNC_RUNS.items():
            runner = FSDPRunner.from_cfg(Config(_config(root, f'{wrapper}-{run}', wrapper_cfg,
                                                        **options)))
            runner.train()
            out[f'{wrapper}/{run}'] = _records(runner)
    syncbn = dict(WRAPPERS, **{'fsdp2-meta': dict(FSDP2, init_device='meta'),
                               'fsdp1-meta': dict(FSDP1, init_device='meta')})
    for wrapper, wrapper_cfg in syncbn.items():
        runner = FSDPRunner.from_cfg(Config(_config(root, f'{wrapper}-syncbn', wrapper_cfg,
                                                    norm='SyncBN')))
        runner.train()
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model
        out[f'{wrapper}/syncbn'] = dict(
            log=_log_text(runner),
            norms={name: type(m).__name__ for name, m in model.named_modules()
                   if isinstance(m, nn.modules.batchnorm._BatchNorm)},
            buffers=_records(runner)['after'][-1]['buffers'],
            loss=scalar_history(runner, 'train/loss'))
    runner = FSDPRunner.from_cfg(Config(_config(root, 'sync_bn-key', FSDP2, sync_bn='torch')))
    runner.train()
    out['sync_bn-key'] = dict(log=_log_text(runner), norms=sorted(
        type(m).__name__ for m in runner.model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)))
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_two_ranks, 2, str(tmp_path_factory.mktemp('bn')), timeout=600)


def _apart(a: dict, b: dict) -> float:
    return max_abs_diff({k: v for k, v in a.items() if 'running' in k},
                        {k: v for k, v in b.items() if 'running' in k})


def _mean(buffers: List[dict]) -> dict:
    return {k: sum(b[k].double() for b in buffers) / len(buffers) for k in buffers[0]}


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_without_the_hook_the_ranks_statistics_differ(ranks, wrapper):
    records = [r[f'{wrapper}/plain'] for r in ranks]
    events = [rec['event'] for rec in records[0]['after']]
    assert events == VAL_EVENTS + ['after_train_epoch'], events
    for i, event in enumerate(events):
        assert _apart(records[0]['after'][i]['buffers'],
                      records[1]['after'][i]['buffers']) > RANKS_APART, event


@pytest.mark.parametrize('run', ['sync-val', 'sync-train'])
@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_sync_buffers_hook_gives_every_rank_the_mean(ranks, wrapper, run):
    records = [r[f'{wrapper}/{run}'] for r in ranks]
    events = [rec['event'] for rec in records[0]['before']]
    expected = VAL_EVENTS if run == 'sync-val' else []
    assert events == expected + ['after_train_epoch'], events
    for i, event in enumerate(events):
        before = [rec['before'][i]['buffers'] for rec in records]
        after = [rec['after'][i]['buffers'] for rec in records]
        assert sorted(before[0]) == sorted(f'{m}.{b}' for m in NORM_MODULES for b in (
            'running_mean', 'running_var', 'num_batches_tracked'))
        if run == 'sync-val' and event == 'after_train_epoch':
            # no training since the last validation's sync: already equal, and kept so
            assert _apart(before[0], before[1]) == 0
        else:
            assert _apart(before[0], before[1]) > RANKS_APART, event
        for rank in (0, 1):
            assert max_abs_diff(_mean(after[rank:rank + 1]), _mean(before)) < 1e-6, (event, rank)


SYNCBN_RUNS = list(WRAPPERS) + ['fsdp2-meta', 'fsdp1-meta']


@pytest.mark.parametrize('run', SYNCBN_RUNS)
def test_syncbn_model_trains_on_cpu_ranks_and_the_log_names_the_converted_modules(ranks, run):
    for rank in ranks:
        result = rank[f'{run}/syncbn']
        assert set(result['norms']) == set(NORM_MODULES)
        assert 'SyncBatchNorm' not in result['norms'].values(), result['norms']
        assert len(result['loss']) == ITERS and all(torch.isfinite(torch.tensor(result['loss'])))
    log = ranks[0][f'{run}/syncbn']['log']
    (line,) = [ln for ln in log.splitlines() if 'SyncBatchNorm needs an accelerator' in ln]
    assert 'WARNING' in line and 'embed.1, head.1' in line, line
    assert 'its own running statistics' in line and 'SyncBuffersHook' in line, line
    # each rank kept its own statistics (no hook in these runs)
    assert _apart(ranks[0][f'{run}/syncbn']['buffers'],
                  ranks[1][f'{run}/syncbn']['buffers']) > RANKS_APART


@pytest.mark.parametrize('wrapper', ['fsdp2', 'fsdp1'])
def test_syncbn_under_meta_init_trains_as_without(ranks, wrapper):
    for rank in ranks:
        meta, plain = rank[f'{wrapper}-meta/syncbn'], rank[f'{wrapper}/syncbn']
        assert meta['loss'] == plain['loss']
        assert max_abs_diff(meta['buffers'], plain['buffers']) == 0


def test_sync_bn_key_is_not_applied_on_cpu_ranks_and_says_so(ranks):
    for rank in ranks:
        assert rank['sync_bn-key']['norms'] == ['BatchNorm1d', 'BatchNorm1d']
    assert "sync_bn='torch' ignored" in ranks[0]['sync_bn-key']['log']


def test_a_python_runner_without_env_cfg_starts_with_gloo_on_the_cpu(ranks):
    for rank in ranks:
        start = rank['start_up']
        assert not start['started_before']
        assert start['backend'] == 'gloo'
        assert len(start['loss']) == ITERS


@pytest.mark.parametrize('how', ['python_nccl', 'config_nccl'])
def test_a_backend_nccl_the_user_wrote_is_still_refused_on_every_rank(ranks, how):
    errors = [rank['start_up'][how] for rank in ranks]
    assert errors[0] == errors[1]
    kind, message = errors[0]
    assert kind == 'ValueError' and "env_cfg.dist_cfg.backend: 'nccl'" in message, errors[0]
    assert 'remove the key' in message


class _Seen(Exception):
    """What ``Runner.__init__`` handed ``setup_env``."""


class _Probe(Runner):
    def setup_env(self, env_cfg: dict) -> None:
        raise _Seen(is_mmengine_default_env(env_cfg, self.cfg))


def _default_env(build) -> bool:
    with pytest.raises(_Seen) as seen:
        build()
    return seen.value.args[0]


def test_mmengines_default_env_cfg_is_told_apart_from_the_users(tmp_path):
    nccl = dict(dist_cfg=dict(backend='nccl'))
    base = dict(model=dict(type='NormedClassifier'), work_dir=str(tmp_path))
    assert _default_env(lambda: _Probe(model=nn.Linear(1, 1), work_dir=str(tmp_path)))
    assert _default_env(lambda: _Probe.from_cfg(Config(base)))
    assert not _default_env(lambda: _Probe.from_cfg(Config(dict(base, env_cfg=nccl))))
    assert not _default_env(lambda: _Probe(model=nn.Linear(1, 1), work_dir=str(tmp_path),
                                           env_cfg=copy.deepcopy(nccl)))
    assert not _default_env(lambda: _Probe.from_cfg(Config(dict(
        base, env_cfg=dict(dist_cfg=dict(backend='nccl', timeout=60))))))


def test_one_process_converts_syncbn_and_trains(tmp_path):
    from mmfsdp import FSDPRunner
    cfg = _config(str(tmp_path), 'one-process', FSDP2, norm='SyncBN', val=False)
    runner = FSDPRunner.from_cfg(Config(dict(cfg, launcher='none')))
    runner.train()
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in runner.model.modules())
    assert len(scalar_history(runner, 'train/loss')) == ITERS
    log = _log_text(runner)
    assert 'embed.1, head.1' in log and 'its own running statistics' not in log


@pytest.mark.parametrize('device, kept', [('cpu', False), ('cuda', True)])
def test_syncbn_is_kept_only_where_there_is_an_accelerator(monkeypatch, device, kept):
    import logging

    import mmfsdp.runner
    from mmfsdp import FSDPRunner
    from mmfsdp.runner import WrapState
    from mmfsdp.strategies import translate_strategy
    monkeypatch.setattr(mmfsdp.runner, 'current_device', lambda: torch.device(device))
    runner = FSDPRunner.__new__(FSDPRunner)  # build_model needs only these
    runner._wrap_state, runner._distributed = WrapState(wrapping=None, meta_init=False), True
    runner._strategy = translate_strategy({})  # no FlexibleRunner strategy to log
    runner.cfg = Config({})  # allow_unsafe_checkpoints unset
    runner.logger = logging.getLogger('test_batchnorm')
    model = runner.build_model(NormedClassifier(norm_cfg=dict(type='SyncBN')))
    norms = {n: type(m) for n, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    assert list(norms) == list(NORM_MODULES)
    assert all((cls is nn.SyncBatchNorm) == kept for cls in norms.values()), norms
