"""Random initialisers of a CPU-staged model draw from the training device's generator.

FSDP1 on an accelerator initialises the model on the CPU (it moves it unit by
unit afterwards); the stock Runner initialises on the device. On a CPU-only
machine the device's generator is stood in for by an explicit CPU generator:
a run whose every fill drew from it equals an initialisation from the global
generator seeded alike, and the global generator is left untouched. On a GPU,
tests/test_gpu.py::test_fp32_training_equals_one_process[fsdp1] compares the
staged FSDP1 run with the stock Runner on the device.
"""
import copy

import torch
from mmengine.model import BaseModule
from torch import nn

from mmfsdp.device_draws import draws_on

SEED = 7


class Initialised(BaseModule):
    """mmengine's random initialisers, torch's, and an attention module's private one."""

    def __init__(self) -> None:
        super().__init__(init_cfg=[
            dict(type='Kaiming', layer='Conv2d'),
            dict(type='TruncNormal', layer='Linear', std=0.02),
            dict(type='Xavier', layer='Embedding', distribution='uniform'),
        ])
        self.conv = nn.Conv2d(3, 4, 3)
        self.linear = nn.Linear(8, 8)
        self.embedding = nn.Embedding(10, 8)
        self.attn = nn.MultiheadAttention(8, 2)
        self.norm = nn.LayerNorm(8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.register_buffer('mask', torch.ones(8))

    def init_weights(self) -> None:
        super().init_weights()
        self.attn._reset_parameters()
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.uniform_(self.norm.weight[:4])  # a dense view
        self.mask.bernoulli_(0.5)


def _equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_every_fill_of_the_model_draws_from_the_device_generator():
    torch.manual_seed(0)
    built = Initialised()
    staged, reference = copy.deepcopy(built), copy.deepcopy(built)
    cpu_state = torch.get_rng_state()
    with draws_on(torch.device('cpu'), staged, torch.Generator().manual_seed(SEED)) as mode:
        staged.init_weights()
    assert torch.equal(torch.get_rng_state(), cpu_state)  # nothing drawn from the CPU's
    torch.manual_seed(SEED)
    reference.init_weights()
    assert _equal(staged, reference)
    assert mode.redirected >= 8
    assert not _equal(staged, built)


def test_fills_of_other_tensors_draw_as_they_would_on_the_device():
    model = nn.Linear(2, 2)
    cpu_state = torch.get_rng_state()
    with draws_on(torch.device('cpu'), model, torch.Generator().manual_seed(SEED)) as mode:
        torch.empty(5).normal_()  # a CPU temporary of an initialiser: the CPU's generator
    assert not torch.equal(torch.get_rng_state(), cpu_state)
    assert mode.redirected == 0


def test_a_generator_the_initialiser_names_is_kept():
    model, reference = nn.Linear(4, 4), nn.Linear(4, 4)
    with draws_on(torch.device('cpu'), model, torch.Generator().manual_seed(SEED)) as mode:
        nn.init.normal_(model.weight, generator=torch.Generator().manual_seed(3))
    nn.init.normal_(reference.weight, generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.weight, reference.weight)
    assert mode.redirected == 0
