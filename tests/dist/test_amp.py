"""fp16 AMP on CPU with a shard-aware loss scaler; its state survives a resume.

The checks share one 2-process gloo group.
"""
import pytest
import torch
from mmengine.config import Config

import contract_models  # noqa: F401  (registers the models)
from harness import DIST_CFG, run_distributed
from toy import DDP, FSDP1, ToyClassifier, runner_config

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

AMP = dict(type='mmfsdp.AmpOptimWrapper', dtype='float16',
           optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=1.0))
INIT_SCALE = 2.0**10


def _step_with_inf_on_rank_1(wrapper_cfg: dict) -> dict:
    """One AMP step where rank 1 alone sees an inf in its gradients (starts the group if none)."""
    from mmfsdp import AmpOptimWrapper
    from mmfsdp.dist import init_distributed
    from mmfsdp.wrappers import MMDistributedDataParallel, MMFullyShardedDataParallel
    if not torch.distributed.is_initialized():
        init_distributed('pytorch', DIST_CFG)
    torch.manual_seed(0)
    if wrapper_cfg['type'] == FSDP1['type']:
        model = MMFullyShardedDataParallel.from_options(ToyClassifier(), auto_wrap_policy=FSDP1[
            'auto_wrap_policy'])
    else:
        model = MMDistributedDataParallel(ToyClassifier())
    optim = AmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            loss_scale=dict(init_scale=INIT_SCALE))
    optim.bind_model(model)
    before = [p.detach().clone() for p in model.parameters()]
    rank = torch.distributed.get_rank()
    with optim.optim_context(model):
        loss = model(torch.randn(4, 6), torch.zeros(4, dtype=torch.long), mode='loss')['loss']
    if isinstance(model, MMDistributedDataParallel) and rank == 1:
        loss = loss * float('inf')  # DDP: gradients are reduced, so inf reaches every rank
    optim.backward(loss)
    if isinstance(model, MMFullyShardedDataParallel) and rank == 1:
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
        grad.view(-1)[0] = float('inf')  # FSDP1: only rank 1's shard of the gradient
    optim.step()
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return dict(changed=changed, scale=optim.loss_scaler.get_scale(),
                scaler=type(optim.loss_scaler).__name__)


def _train(root: str, wrapper: dict, resume: bool) -> dict:
    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    name = f"{wrapper['type'].split('.')[-1]}-{'resumed' if resume else 'straight'}"
    cfg = runner_config(name, f'{root}/{name}', wrapper=wrapper, batch_size=4, max_iters=8,
                        optim_wrapper=dict(AMP, loss_scale=dict(init_scale=2.0**20,
                                                                growth_interval=2)))
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=4, by_epoch=False)
    if resume:
        straight = f"{root}/{name.replace('resumed', 'straight')}/iter_4.pth"
        cfg.update(load_from=straight, resume=True)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    losses = runner.message_hub.get_scalar('train/loss').data[0]
    state = gather_full_state(runner.model, None)[0]
    return dict(state=state, scale=runner.optim_wrapper.loss_scaler.get_scale(),
                scaler=type(runner.optim_wrapper.loss_scaler).__name__,
                losses=[float(v) for v in losses])


def _gan_step_with_inf_on_rank_1(root: str) -> dict:
    """One AMP step of a GAN (its own train_step, two optim wrappers) under FSDP1 (separate
    roots), the discriminator's gradient overflowing in rank 1's shard only."""
    from mmfsdp import FSDPRunner
    amp = dict(type='mmfsdp.AmpOptimWrapper', dtype='float16',
               optimizer=dict(type='AdamW', lr=1e-2), loss_scale=dict(init_scale=INIT_SCALE))
    cfg = runner_config('gan-amp', f'{root}/gan-amp', batch_size=4, max_iters=1,
                        wrapper=dict(type='mmfsdp.MMFullyShardedDataParallel'),
                        optim_wrapper=dict(constructor='PerChildOptimConstructor',
                                           generator=amp, discriminator=amp))
    cfg['model'] = dict(type='OverflowOnRank1GAN')
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    return runner.model.module.record


def _all(root: str) -> dict:
    import mmfsdp  # noqa: F401
    out = {}
    out['gan/inf on rank 1'] = _gan_step_with_inf_on_rank_1(root)
    for key, wrapper in (('fsdp', FSDP1), ('ddp', DDP)):
        out[f'{key}/inf on rank 1'] = _step_with_inf_on_rank_1(wrapper)
    for key, wrapper in (('fsdp', FSDP1), ('ddp', DDP)):
        out[f'{key}/straight'] = _train(root, wrapper, resume=False)
        out[f'{key}/resumed'] = _train(root, wrapper, resume=True)
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_all, 2, str(tmp_path_factory.mktemp('amp')))


@pytest.mark.parametrize('key', ['fsdp', 'ddp'])
def test_all_ranks_skip_the_step_when_one_rank_sees_inf(ranks, key):
    assert [r[f'{key}/inf on rank 1']['changed'] for r in ranks] == [False, False]
    assert [r[f'{key}/inf on rank 1']['scale'] for r in ranks] == [INIT_SCALE / 2] * 2


def test_gan_with_its_own_steps_under_fsdp1_skips_on_every_rank_and_keeps_one_scale(ranks):
    """Each child is its own FSDP1 root, the wrapper none: the scaler still agrees on inf/nan."""
    got = [r['gan/inf on rank 1'] for r in ranks]
    print(f'GAN under FSDP1, inf in rank 1\'s shard: {got}')
    assert [r['stepped'] for r in got] == [False, False]
    assert [r['scale'] for r in got] == [INIT_SCALE / 2] * 2


@pytest.mark.parametrize('key, scaler', [('fsdp', 'ShardedGradScaler'), ('ddp', 'GradScaler')])
def test_scaler_follows_the_wrapper(ranks, key, scaler):
    assert {r[f'{key}/straight']['scaler'] for r in ranks} == {scaler}


@pytest.mark.parametrize('key', ['fsdp', 'ddp'])
def test_fp16_trains_on_cpu(ranks, key):
    losses = ranks[0][f'{key}/straight']['losses']
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize('key', ['fsdp', 'ddp'])
def test_scaler_state_is_saved_and_resumed(ranks, key):
    for rank in ranks:
        straight, resumed = rank[f'{key}/straight'], rank[f'{key}/resumed']
        assert resumed['scale'] == straight['scale'] != 2.0**20  # it moved, and came back
        diff = max((resumed['state'][k] - straight['state'][k]).abs().max().item()
                   for k in straight['state'])
        assert diff <= 1e-6
