"""FSDP2 with parameters that some ranks do not use: ``find_unused_parameters=True``.

The model's auxiliary head is used on rank 0 only. FSDP2 reduces only the
gradients a rank has, so without the option the ranks' reduce-scatters differ
(a hang): the first training forward detects it and every rank raises; with
it every rank reduces a zero gradient for what it did not use, as DDP's
``find_unused_parameters`` and FSDP1 do, and training equals DDP's.
"""
import os

import pytest
from mmengine.config import Config
from mmengine.registry import MODELS
from torch import nn

from harness import run_distributed
from toy import IN_DIM, ToyClassifier, runner_config

POLICY = dict(type='transformer', layer_cls=['ToyBlock'])


@MODELS.register_module()
class RankZeroHeadClassifier(ToyClassifier):
    """``ToyClassifier`` plus an auxiliary loss whose head only rank 0 uses."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.aux_head = nn.Linear(IN_DIM, 1)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = super().forward(inputs, data_samples, mode)
        if mode == 'loss' and int(os.environ['RANK']) == 0:
            out['aux_loss'] = self.aux_head(inputs).pow(2).mean()
        return out


def _train(root: str) -> dict:
    import mmfsdp
    from mmfsdp.checkpoint.state import gather_full_state
    out = {}
    for name, wrapper in [
            ('fsdp2', dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=POLICY,
                           find_unused_parameters=True)),
            ('ddp', dict(type='mmfsdp.MMDistributedDataParallel', find_unused_parameters=True))]:
        cfg = runner_config(name, f'{root}/{name}', batch_size=4, max_iters=3, wrapper=wrapper)
        cfg['model'] = dict(type='RankZeroHeadClassifier')
        runner = mmfsdp.FSDPRunner.from_cfg(Config(cfg))
        runner.train()
        out[name] = gather_full_state(runner.model, None)[0]
    cfg = runner_config('detect', f'{root}/detect', batch_size=4, max_iters=3,
                        wrapper=dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=POLICY))
    cfg['model'] = dict(type='RankZeroHeadClassifier')
    try:
        mmfsdp.FSDPRunner.from_cfg(Config(cfg)).train()
        out['without option'] = None
    except RuntimeError as e:
        out['without option'] = str(e)
    return out


@pytest.fixture(scope='module')
def trained(tmp_path_factory) -> list:
    return run_distributed(_train, 2, str(tmp_path_factory.mktemp('unused')))


def test_head_used_on_rank0_only_trains_like_ddp(trained):
    fsdp2, ddp = trained[0]['fsdp2'], trained[0]['ddp']
    assert sorted(fsdp2) == sorted(ddp)
    diff = max((fsdp2[k] - ddp[k]).abs().max().item() for k in ddp)
    assert diff <= 1e-6, diff


def test_without_the_option_the_first_step_names_the_parameters_on_every_rank(trained):
    messages = [rank['without option'] for rank in trained]
    assert messages[0] is not None and messages[0] == messages[1]
    for fragment in ['aux_head.weight (used on rank 0 only)', 'aux_head.bias',
                     'model_wrapper_cfg.find_unused_parameters=True']:
        assert fragment in messages[0], (fragment, messages[0])
