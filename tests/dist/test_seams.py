"""The seams between mmfsdp's parts, on one 2-process group.

- a config is resolved once and the model walked once per process;
- wrapping in ``train()`` checks that the optimizer is built and the weights
  are initialised: mmengine's order works, a changed order raises
  (:class:`mmfsdp.runner.WrapPreconditions`); ``FlexibleRunner`` is refused like the stock Runner;
- DDP clips by the norm of its replicated gradients;
- ``MMFullyShard`` names everything as the unwrapped model does.
"""
import collections

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner
from torch import nn

from harness import raised, run_distributed
from mmfsdp import (
    MMDistributedDataParallel,
    MMFullyShard,
)
from mmfsdp.registry import FSDP_WRAP_POLICIES
from mmfsdp.wrappers import FullyShardConfig
from toy import ToyBlock, ToyClassifier, runner_config

BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
FSDP = 'mmfsdp.MMFullyShardedDataParallel'


# ---- one 2-process group -------------------------------------------------------------------


class _LoadFirst(Runner):
    """An mmengine whose ``train()`` loads (wraps) before building the optimizer."""

    def train(self):
        self._train_loop = self.build_train_loop(self._train_loop)
        self.load_or_resume()
        raise AssertionError('load_or_resume should have refused')


class _InitLast(Runner):
    """An mmengine whose ``train()`` initialises the weights after loading (wrapping)."""

    def train(self):
        self._train_loop = self.build_train_loop(self._train_loop)
        self.optim_wrapper = self.build_optim_wrapper(self.optim_wrapper)
        self.call_hook('before_run')
        self.load_or_resume()
        raise AssertionError('load_or_resume should have refused')


class _Scaled(ToyClassifier):
    """The toy model with a parameter of the root module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))


def _runner_checks(work_root: str, out: dict) -> None:
    from mmengine.runner import FlexibleRunner

    from mmfsdp import FSDPRunner

    def config(name, **extra):
        cfg = runner_config(name, f'{work_root}/{name}', batch_size=4, max_iters=2,
                            wrapper=dict(type=FSDP, auto_wrap_policy=BLOCKS))
        cfg.update(extra)
        return Config(cfg)

    runner = FSDPRunner.from_cfg(config('documented'))
    out['documented'] = raised(runner.train) + (type(runner.model).__name__, )
    for name, order in (('load first', _LoadFirst), ('init last', _InitLast)):
        runner_cls = type(f'Reordered{order.__name__}', (FSDPRunner, order), {})
        runner = runner_cls.from_cfg(config(name.replace(' ', '_')))
        out[name] = raised(runner.train) + (type(runner.model).__name__, )
    for wrapper in ('mmfsdp.MMFullyShard', FSDP):
        cfg = runner_config('flexible', f'{work_root}/flexible', batch_size=4, max_iters=1)
        cfg['strategy'] = dict(type='DDPStrategy', model_wrapper=dict(type=wrapper))
        cfg = Config(cfg)
        out[f'flexible {wrapper}'] = raised(lambda c=cfg: FlexibleRunner.from_cfg(c).train())


def _ddp_clip(out: dict) -> None:
    torch.manual_seed(0)
    model = MMDistributedDataParallel(ToyClassifier())
    rank = torch.distributed.get_rank()
    model(torch.randn(4, 6) + rank, torch.tensor([0, 1, 2, rank]), mode='loss')['loss'].backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    norm = model.clip_grad_norm_(0.01)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    out['ddp clip'] = (float(norm), float(expected), float(clipped))


def _fsdp2_names(out: dict) -> None:
    torch.manual_seed(0)
    reference = _Scaled()
    wrapper = MMFullyShard.from_options(_Scaled(), auto_wrap_policy=BLOCKS)
    params = dict(wrapper.named_parameters())
    out['names'] = dict(
        parameters=(list(params), [n for n, _ in reference.named_parameters()]),
        buffers=([n for n, _ in wrapper.named_buffers()],
                 [n for n, _ in reference.named_buffers()]),
        modules=([n for n, _ in wrapper.named_modules()],
                 [n for n, _ in reference.named_modules()]),
        state_dict=(sorted(wrapper.state_dict()), sorted(reference.state_dict())),
    )
    out['get_parameter finds each named parameter'] = all(
        wrapper.get_parameter(n) is p for n, p in params.items())
    out['named module owns each parameter'] = all(
        getattr(dict(wrapper.named_modules())[n.rpartition('.')[0]], n.rpartition('.')[2]) is p
        for n, p in params.items())
    out['modules'] = (any(m is wrapper for m in wrapper.modules()),
                      next(iter(wrapper.modules())) is wrapper.module)
    out['children'] = [n for n, _ in wrapper.named_children()]
    wrapper.eval()
    out['eval reaches the model'] = not wrapper.module.training


def _counted_run(work_root: str, out: dict) -> None:
    """An FSDP2 run (plan log and rank agreement on) counting resolutions and model walks."""
    from mmfsdp import FSDPRunner
    counts: collections.Counter = collections.Counter()
    real = FullyShardConfig.from_dict.__func__

    def counting(cls, cfg):
        counts['resolutions'] += 1
        return real(cls, cfg)

    @FSDP_WRAP_POLICIES.register_module(name='counting_blocks', force=True)
    def counting_blocks(module, recurse, nonwrapped_numel):
        counts['walks'] += isinstance(module, ToyClassifier) and recurse
        return recurse or isinstance(module, ToyBlock)

    FullyShardConfig.from_dict = classmethod(counting)
    try:
        cfg = runner_config('counted', f'{work_root}/counted', batch_size=4, max_iters=1,
                            wrapper=dict(type='mmfsdp.MMFullyShard',
                                         auto_wrap_policy=dict(type='counting_blocks')))
        cfg['log_level'] = 'INFO'  # the plan is logged
        FSDPRunner.from_cfg(Config(cfg)).train()
    finally:
        FullyShardConfig.from_dict = classmethod(real)
    out['counted'] = dict(counts)


def _seams(work_root: str) -> dict:
    out: dict = {}
    _runner_checks(work_root, out)  # FSDPRunner starts the group the other checks use
    _counted_run(work_root, out)
    _ddp_clip(out)
    _fsdp2_names(out)
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_seams, 2, str(tmp_path_factory.mktemp('seams')))


def test_one_resolution_of_the_config_and_one_walk_of_the_model_per_process(ranks):
    assert [r['counted'] for r in ranks] == [dict(resolutions=1, walks=1)] * 2


def test_documented_train_order_wraps_and_trains(ranks):
    assert [r['documented'] for r in ranks] == [(None, None, 'MMFullyShardedDataParallel')] * 2


def test_wrapping_before_the_optimizer_is_built_raises_on_every_rank(ranks):
    for rank in ranks:
        error, message, model = rank['load first']
        assert error == 'LifecycleError', message
        assert 'optim wrapper is not built' in message and 'build_optim_wrapper' in message
        assert model == 'ToyClassifier'  # refused before anything was wrapped


def test_wrapping_before_the_weights_are_initialised_raises_on_every_rank(ranks):
    for rank in ranks:
        error, message, model = rank['init last']
        assert error == 'LifecycleError', message
        assert 'weights are not initialised' in message and '_init_model_weights' in message
        assert 'optim wrapper' not in message
        assert model == 'ToyClassifier'


@pytest.mark.parametrize('wrapper', ['mmfsdp.MMFullyShard', FSDP])
def test_flexible_runner_is_refused_like_the_stock_runner(ranks, wrapper):
    for rank in ranks:
        error, message = rank[f'flexible {wrapper}']
        assert error == 'RuntimeError', message
        assert "FlexibleRunner" in message and "runner_type='mmfsdp.FSDPRunner'" in message


def test_ddp_clips_by_the_norm_of_its_replicated_gradients(ranks):
    norms = [r['ddp clip'] for r in ranks]
    assert norms[0][:2] == norms[1][:2]  # all-reduced gradients: one norm everywhere
    for norm, expected, clipped in norms:
        assert norm == pytest.approx(expected) and clipped == pytest.approx(0.01, rel=1e-4)


def test_fully_shard_names_everything_as_the_unwrapped_model(ranks):
    for rank in ranks:
        for kind, (got, expected) in rank['names'].items():
            assert got == expected, kind
        assert rank['get_parameter finds each named parameter']
        assert rank['named module owns each parameter']
        assert rank['modules'] == (False, True)  # the model is '', the wrapper not listed
        assert rank['children'] == ['module']  # the structure: train/to/apply reach the model
        assert rank['eval reaches the model']
