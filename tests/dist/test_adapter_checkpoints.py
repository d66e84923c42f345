"""Checkpoints hold what the model's own ``state_dict()`` returns, under every wrapper.

XTuner's LoRA model returns only its adapter from ``state_dict()``: the frozen base
model comes from its pretrained files, and mmengine's stock Runner saves
``model.state_dict()``. FSDP1 and DDP gather state through their own module tree,
which never calls the model's method; the checkpoint held the whole base model
there (at 7B, its gigabytes in every save). Here a toy adapter model saves full
and sharded checkpoints under FSDP1, FSDP2 and DDP at 2 ranks: they hold the
stock run's keys, and resuming from them ends where the uninterrupted run ends.
"""
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from mmengine.registry import MODELS
from mmengine.runner import Runner
from torch import nn

from harness import max_abs_diff, run_distributed
from mmfsdp import FSDPRunner
from mmfsdp.checkpoint.safe_io import load_file
from mmfsdp.checkpoint.state import checkpoint_model_shapes
from toy import NUM_CLASSES, WRAPPERS, ToyClassifier, checkpointing_config

TYPES = ('full', 'sharded')
GLOBAL_BATCH, HALF, TOTAL = 8, 2, 4
PROBE = torch.linspace(-2, 2, 5 * 6).reshape(5, 6)


@MODELS.register_module()
class AdapterClassifier(ToyClassifier):
    """The toy classifier frozen, with a trainable low-rank adapter on its head, whose
    ``state_dict()`` returns the adapter only (as XTuner's ``SupervisedFinetune`` with LoRA)."""

    def __init__(self, dim: int = 16, rank: int = 2) -> None:
        super().__init__(dim=dim)
        self.requires_grad_(False)
        self.lora_A = nn.Linear(dim, rank)
        self.lora_B = nn.Linear(rank, NUM_CLASSES)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = self.head(x) + self.lora_B(self.lora_A(x))
        return dict(loss=F.cross_entropy(logits, data_samples)) if mode == 'loss' else logits

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        return type(state)((k, v) for k, v in state.items() if 'lora_' in k)


_config = functools.partial(checkpointing_config, global_batch=GLOBAL_BATCH, max_iters=TOTAL,
                            interval=HALF, model=dict(type='AdapterClassifier'))


def _everything(root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    out = {}
    for wrapper in WRAPPERS:
        for kind in TYPES:
            run = f'{wrapper}-{kind}'
            for name, extra in ((run, dict(state_dict_type=kind)),
                                (f'{run}-resumed', dict(resume_from=os.path.join(
                                    root, run, f'iter_{HALF}.pth')))):
                runner = FSDPRunner.from_cfg(_config(f'{root}/{name}', WRAPPERS[wrapper], 2,
                                                     **extra))
                runner.train()
                state = get_model_state_dict(runner.model,
                                             options=StateDictOptions(full_state_dict=True))
                with torch.no_grad():  # every weight, the frozen base's too
                    probe = runner.model(PROBE, mode='tensor').clone()
                out[name] = dict(state={k: v.detach().clone() for k, v in state.items()},
                                 probe=probe)
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('adapter'))
    ranks = run_distributed(_everything, 2, root)
    stock_cfg = _config(f'{root}/stock', None, 1)
    del stock_cfg.default_hooks.checkpoint['state_dict_type']  # mmfsdp's key
    stock = Runner.from_cfg(stock_cfg)
    stock.train()
    # the stock Runner's own file (mmengine pickles its message hub): this test wrote it
    stock_file = load_file(os.path.join(root, 'stock', f'iter_{TOTAL}.pth'), allow_unsafe=True)
    return dict(root=root, ranks=ranks, stock_keys=sorted(stock_file['state_dict']))


def _saved_keys(path: str) -> list:
    if os.path.isdir(path):
        return sorted(checkpoint_model_shapes(path))
    return sorted(load_file(path)['state_dict'])


def test_the_stock_checkpoint_holds_the_adapter_only(runs):
    assert runs['stock_keys'] == ['lora_A.bias', 'lora_A.weight', 'lora_B.bias', 'lora_B.weight']


@pytest.mark.parametrize('kind', TYPES)
@pytest.mark.parametrize('wrapper', sorted(WRAPPERS))
def test_a_checkpoint_holds_what_the_models_state_dict_returns(runs, wrapper, kind):
    for iteration in (HALF, TOTAL):
        path = os.path.join(runs['root'], f'{wrapper}-{kind}', f'iter_{iteration}.pth')
        assert _saved_keys(path) == runs['stock_keys']


@pytest.mark.parametrize('kind', TYPES)
@pytest.mark.parametrize('wrapper', sorted(WRAPPERS))
def test_resuming_from_an_adapter_checkpoint_ends_at_the_uninterrupted_run(runs, wrapper, kind):
    rank0 = runs['ranks'][0]
    uninterrupted, resumed = rank0[f'{wrapper}-{kind}'], rank0[f'{wrapper}-{kind}-resumed']
    assert max_abs_diff(resumed['state'], uninterrupted['state']) == 0.0
    assert torch.equal(resumed['probe'], uninterrupted['probe'])
