"""Evaluation before training, and evaluation batches per rank, on one 2-process group.

- ``runner.val()`` / ``runner.test()`` then ``runner.train()`` on one FSDPRunner:
  DDP and FSDP2 train to the weights of mmengine's stock Runner doing the same
  on one process (the evaluation's dataloader draws from torch's RNG before
  ``init_weights`` does); FSDP1, whose evaluation made every parameter a flat
  shard, refuses ``train()`` at the call, naming why and what to do. FSDP2
  under meta init (wrapped at construction) trains after an evaluation as without.
- A val / test sampler with ``round_up=False`` whose ranks would run different
  numbers of batches is refused under FSDP1 and FSDP2 (every evaluation batch
  all-gathers on every rank) when the loop is built, before it runs; one whose
  ranks run equal numbers evaluates; DDP's evaluation is no collective and runs.
"""
import pytest
from mmengine.config import Config
from mmengine.runner import Runner

from harness import max_abs_diff, raised, run_distributed
from toy import DDP, FSDP1, FSDP2, runner_config

WRAPPERS = dict(fsdp1=FSDP1, fsdp2=FSDP2, ddp=DDP)
#: Validation samples and batch size: 21 on 2 ranks are 11 and 10, 6 and 5 batches of 2,
#: 3 and 3 batches of 4.
UNEVEN, EVEN = (21, 2), (21, 4)
#: fp32 AdamW, 2 ranks x 4 samples against one batch of 8 (as tests/dist/test_accumulation.py)
TOL = 2e-5


def _runner(name: str, root: str, wrapper: dict, val=None):
    from mmfsdp import FSDPRunner
    cfg = runner_config(name, f'{root}/{name}', wrapper=wrapper, batch_size=4, max_iters=3,
                        val=True)
    if val is not None:
        for key in ('val_dataloader', 'test_dataloader'):
            cfg[key]['dataset']['length'], cfg[key]['batch_size'] = val
            cfg[key]['sampler']['round_up'] = False
        cfg['train_cfg']['val_interval'] = 1
    return FSDPRunner.from_cfg(Config(cfg))


def _weights(runner) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    return {k: v.detach().clone() for k, v in gather_full_state(runner.model, None)[0].items()}


def _lifecycle(root: str) -> dict:
    out = {}
    for first in (None, 'val', 'test'):  # meta init: wrapped at construction, before val()
        runner = _runner(f'meta-{first}-first', root, dict(FSDP2, init_device='meta'))
        if first:
            getattr(runner, first)()
        runner.train()
        out['meta', first] = _weights(runner)
    for name, wrapper in WRAPPERS.items():
        for first in ('val', 'test'):
            runner = _runner(f'{name}-{first}-first', root, wrapper)
            getattr(runner, first)()
            out[name, first] = dict(error=raised(runner.train), iter=runner.iter,
                                    weights=_weights(runner))
        for label, val in (('uneven', UNEVEN), ('even', EVEN)):
            runner = _runner(f'{name}-{label}', root, wrapper, val)
            out[name, label, 'val'] = raised(runner.val)
            out[name, label, 'test'] = raised(runner.test)
            runner = _runner(f'{name}-{label}-train', root, wrapper, val)
            out[name, label, 'train'] = raised(runner.train) + (runner.iter, )
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_lifecycle, 2, str(tmp_path_factory.mktemp('lifecycle')),
                           timeout=420)


@pytest.mark.parametrize('first', ['val', 'test'])
def test_ddp_and_fsdp2_train_after_an_evaluation_as_the_stock_runner_on_one_process(
        ranks, first, tmp_path):
    """Before: FSDP2 ``NotImplementedError: Operator c10d.broadcast_.default does not have a
    sharding strategy registered`` (the weights initialised again on the sharded model)."""
    cfg = runner_config('stock', str(tmp_path), launcher='none', batch_size=8, max_iters=3,
                        val=True)
    stock = Runner.from_cfg(Config(cfg))
    getattr(stock, first)()
    stock.train()
    for rank in ranks:
        for wrapper in ('ddp', 'fsdp2'):
            run = rank[wrapper, first]
            assert run['error'] == (None, None) and run['iter'] == 3
            diff = max_abs_diff(run['weights'], stock.model.state_dict())
            print(f'{wrapper} {first}() then train(): {diff:.1e} from the stock Runner')
            assert diff <= TOL


@pytest.mark.parametrize('first', ['val', 'test'])
def test_fsdp2_meta_init_trains_after_an_evaluation_as_without(ranks, first):
    """Before: the optimizer was built from the root's gathered tensors, which FSDP2 keeps
    after the evaluation's forward: 18 of 24 parameters stepped, 3.0e-2 off after 3
    iterations."""
    for rank in ranks:
        assert max_abs_diff(rank['meta', first], rank['meta', None]) == 0.0


@pytest.mark.parametrize('first', ['val', 'test'])
def test_fsdp1_train_after_an_evaluation_is_refused_at_the_call(ranks, first):
    """Before: ``ValueError: not enough values to unpack`` (the weights initialised again on
    the wrapped model)."""
    for rank in ranks:
        run = rank['fsdp1', first]
        error, message = run['error']
        assert error == 'LifecycleError', message
        assert 'runner.train() after runner.val() / runner.test()' in message
        assert 'flat 1-D shards' in message and 'FSDPRunner.from_cfg(cfg).train()' in message
        assert "'mmfsdp.MMFullyShard'" in message
        assert run['iter'] == 0


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2'])
def test_uneven_evaluation_batches_are_refused_before_the_loop_runs(ranks, wrapper):
    """Before: rank 0's sixth batch all-gathered alone (a hang until the collective timeout)."""
    for rank in ranks:
        for split, key in (('val', 'val_dataloader'), ('test', 'test_dataloader'),
                           ('train', 'val_dataloader')):
            error, message, *iters = rank[wrapper, 'uneven', split]
            assert error == 'ValueError', (split, message)
            assert f'{key}.sampler.round_up=False' in message and '[6, 5] batches' in message
            assert f'{key}.sampler.round_up=True' in message
            assert iters in ([], [0])  # train(): refused before its first iteration


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2', 'ddp'])
def test_evaluation_runs_where_every_rank_has_as_many_batches(ranks, wrapper):
    for rank in ranks:
        for split in ('val', 'test'):
            assert rank[wrapper, 'even', split] == (None, None)
        assert rank[wrapper, 'even', 'train'] == (None, None, 3)
        if wrapper == 'ddp':  # no collective in DDP's evaluation: unequal batches run too
            assert rank[wrapper, 'uneven', 'val'] == (None, None)
            assert rank[wrapper, 'uneven', 'train'] == (None, None, 3)
