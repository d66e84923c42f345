"""``clip_grad`` takes ``torch.nn.utils.clip_grad_norm_``'s keywords under every wrapper.

XTuner's shipped configs write ``clip_grad=dict(max_norm=1, error_if_nonfinite=False)``;
``foreach`` picks torch's kernel. Each keyword means what it means to torch, over the
gradients of all ranks: the runs equal mmengine's stock ``Runner`` on one process, and a
non-finite norm with ``error_if_nonfinite=True`` stops every rank at the same step, as it
stops the stock run.
"""
import pytest
import torch
from mmengine.config import Config
from mmengine.registry import MODELS
from mmengine.runner import Runner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from harness import max_abs_diff, raised, run_distributed, scalar_history
from mmfsdp import FSDPRunner
from toy import WRAPPERS, ToyClassifier, runner_config, train_one_process

TOL = 2e-5
PER_RANK_BATCH, WORLD_SIZE = 4, 2
TORCH_KEYS = dict(max_norm=0.05, norm_type=2.0, error_if_nonfinite=False, foreach=True)


@MODELS.register_module()
class InfAtThirdStep(ToyClassifier):
    """The toy classifier whose loss is infinite at its third training forward on the last rank
    (on the only rank of one process), so the global gradient norm is non-finite there."""

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = super().forward(inputs, data_samples, mode)
        if mode == 'loss':
            self.calls = getattr(self, 'calls', 0) + 1
            last = (not torch.distributed.is_initialized()
                    or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1)
            if self.calls == 3 and last:
                out = dict(loss=out['loss'] * float('inf'))
        return out


def _config(name, work_dir, wrapper, clip_grad, model='ToyClassifier', batch_size=PER_RANK_BATCH):
    cfg = runner_config(name, work_dir, batch_size=batch_size, wrapper=wrapper,
                        launcher='pytorch' if wrapper else 'none',
                        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-2),
                                           clip_grad=clip_grad))
    cfg['model'] = dict(type=model)
    return cfg


def _two_ranks(root):
    out = {}
    for name, wrapper in WRAPPERS.items():
        runner = FSDPRunner.from_cfg(Config(_config(name, root, wrapper, TORCH_KEYS)))
        runner.train()
        state = get_model_state_dict(runner.model, options=StateDictOptions(full_state_dict=True))
        out[name] = dict(state={k: v.detach().clone() for k, v in state.items()},
                         grad_norm=scalar_history(runner, 'train/grad_norm'))
        nonfinite = FSDPRunner.from_cfg(Config(_config(
            f'{name}-inf', root, wrapper, dict(TORCH_KEYS, error_if_nonfinite=True),
            model='InfAtThirdStep')))
        out[f'{name}-inf'] = dict(error=raised(nonfinite.train), iter=nonfinite.iter)
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('clip'))
    ranks = run_distributed(_two_ranks, WORLD_SIZE, root)
    cfg = _config('stock', root, None, TORCH_KEYS, batch_size=PER_RANK_BATCH * WORLD_SIZE)
    stock = train_one_process(cfg)
    inf_cfg = _config('stock-inf', root, None, dict(TORCH_KEYS, error_if_nonfinite=True),
                      model='InfAtThirdStep', batch_size=PER_RANK_BATCH * WORLD_SIZE)
    stock_inf = Runner.from_cfg(Config(inf_cfg))
    return dict(ranks=ranks, stock=stock,
                stock_inf=dict(error=raised(stock_inf.train), iter=stock_inf.iter))


@pytest.mark.parametrize('wrapper', sorted(WRAPPERS))
def test_torch_clip_keywords_train_as_the_stock_runner(runs, wrapper):
    got = runs['ranks'][0][wrapper]
    assert max_abs_diff(got['state'], runs['stock']['state']) < TOL
    assert got['grad_norm'] == pytest.approx(runs['stock']['grad_norm'], rel=1e-4)


@pytest.mark.parametrize('wrapper', sorted(WRAPPERS))
def test_a_non_finite_norm_with_error_if_nonfinite_stops_every_rank_at_the_stock_step(
        runs, wrapper):
    stock = runs['stock_inf']
    assert stock['error'][0] == 'RuntimeError' and 'non-finite' in stock['error'][1]
    for rank in runs['ranks']:
        kind, message = rank[f'{wrapper}-inf']['error']
        assert kind == 'RuntimeError' and 'non-finite' in message, message
        assert 'error_if_nonfinite=False' in message
        assert rank[f'{wrapper}-inf']['iter'] == stock['iter']
