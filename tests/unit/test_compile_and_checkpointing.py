"""Activation checkpointing and regional compile without a process group.

What each checkpointing mode keeps (gradients equal to plain layers', fewer
activations under a lower memory budget, the plan's prediction per mode) and
every misconfiguration refused at start-up, naming the key.
"""
import copy

import pytest
import torch

from harness import max_abs_diff
from toy import (
    IN_DIM,
    WRAPPERS,
    ToyClassifier,
)

GLOBAL_BATCH, ITERS, INTERVAL = 8, 4, 2
BLOCK = ['ToyBlock']


# ---- what each mode keeps (one process, no process group) --------------------------------

def _prepared(**options) -> torch.nn.Module:
    """The toy model with its layers checkpointed / compiled as FSDP2 would, before sharding."""
    from mmfsdp.wrappers.base import prepare_layers
    from mmfsdp.wrappers.fsdp2 import FullyShardConfig
    torch.manual_seed(0)
    model = ToyClassifier(dim=64, depth=4)
    prepare_layers(model, FullyShardConfig.from_dict(options).layout(model))
    return model


def _loss(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(32, IN_DIM, generator=torch.Generator().manual_seed(1))
    return model(x, torch.zeros(32, dtype=torch.long), mode='loss')['loss']


def _grads(**options) -> dict:
    model = _prepared(**options)
    _loss(model).backward()
    return {i: p.grad.clone() for i, p in enumerate(model.parameters())}  # names gain wrappers


def _saved_bytes(**options) -> int:
    """Bytes autograd keeps for backward in one forward of the prepared toy model."""
    model = _prepared(**options)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model)
    loss.backward()
    return sum(saved)


@pytest.mark.parametrize('mode', ['full', 'selective'])
def test_checkpointed_layers_give_the_gradients_of_plain_ones(mode):
    plain = _grads()
    assert max_abs_diff(_grads(activation_checkpointing=dict(layer_cls=BLOCK, mode=mode)),
                        plain) == 0


class _NormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 3, 1), torch.nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


@pytest.mark.parametrize('mode', ['full', 'selective'])
def test_a_checkpointed_norm_updates_its_running_statistics_once_per_step(mode):
    """Recomputation runs the norm again in training mode; its statistics stay those of one run."""
    from mmfsdp.wrappers.base import prepare_layers
    from mmfsdp.wrappers.fsdp2 import FullyShardConfig
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_NormBlock(), _NormBlock())
    checkpointed = copy.deepcopy(plain)
    prepare_layers(checkpointed, FullyShardConfig.from_dict(dict(
        activation_checkpointing=dict(layer_cls=['_NormBlock'], mode=mode))).layout(checkpointed))
    for step in range(2):
        x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(step))
        for model in (plain, checkpointed):
            model(x).sum().backward()
    for (name, value), ours in zip(plain.named_buffers(), checkpointed.buffers()):
        assert torch.equal(ours, value), name  # the same buffers, in order; names gain wrappers


def test_a_lower_memory_budget_keeps_fewer_activations():
    saved = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        saved[budget] = _saved_bytes(
            regional_compile=dict(layer_cls=BLOCK, backend='aot_eager'),
            activation_checkpointing=dict(mode='memory_budget', memory_budget=budget))
    torch._dynamo.reset()
    import torch._functorch.config as functorch_config
    functorch_config.activation_memory_budget = 1.0  # torch's default, for the tests after
    print(f'saved bytes by memory budget: {saved}')
    assert saved[0.0] < 0.8 * saved[1.0]  # the layers outside the blocks keep theirs


def test_the_plan_predicts_what_each_checkpointing_mode_keeps():
    from mmfsdp import MMFullyShard
    from mmfsdp.plan import trace_for

    def batch(model):
        return (torch.randn(32, IN_DIM), torch.zeros(32, dtype=torch.long)), dict(mode='loss')

    def activations(**options) -> int:
        return trace_for(MMFullyShard, dict(WRAPPERS['fsdp2'], **options),
                         ToyClassifier(dim=64, depth=4), batch).activation_bytes

    none = activations()
    full = activations(activation_checkpointing=dict(layer_cls=BLOCK))
    selective = activations(activation_checkpointing=dict(layer_cls=BLOCK, mode='selective'))
    budget = activations(regional_compile=dict(layer_cls=BLOCK), activation_checkpointing=dict(
        mode='memory_budget', memory_budget=0.5))
    print(f'planned activations: none {none}, selective {selective}, full {full}, '
          f'memory_budget=0.5 {budget}')
    assert full < selective < none and full < budget < none


@pytest.mark.parametrize('options,fragments', [
    (dict(activation_checkpointing=dict(layer_cls=BLOCK, mode='selectiv')),
     ['activation_checkpointing.mode', "'selectiv'", "did you mean 'selective'"]),
    (dict(activation_checkpointing=dict(layer_cls=BLOCK, mode='selective', save_ops=['mm'])),
     ['activation_checkpointing.save_ops', "'mm'", "'aten.mm'"]),
    (dict(activation_checkpointing=dict(layer_cls=BLOCK, save_ops=['aten.mm'])),
     ['activation_checkpointing.save_ops', "mode='selective'"]),
    (dict(activation_checkpointing=dict(mode='memory_budget', memory_budget=0.5)),
     ['memory_budget', 'regional_compile']),
    (dict(regional_compile=dict(layer_cls=BLOCK),
          activation_checkpointing=dict(mode='memory_budget', memory_budget=1.5)),
     ['activation_checkpointing.memory_budget', '1.5', 'from 0']),
    (dict(regional_compile=dict(layer_cls=BLOCK), activation_checkpointing=dict(
        layer_cls=BLOCK, mode='memory_budget', memory_budget=0.5)),
     ['layer_cls', 'regional_compile']),
    (dict(regional_compile=dict(layer_cls=BLOCK, mode='fastest')),
     ['regional_compile', "'fastest'"]),
    (dict(regional_compile=dict(layer_cls=BLOCK, full_graph=True)),
     ['regional_compile', "'full_graph'", "did you mean 'fullgraph'"]),
    (dict(regional_compile=dict(fullgraph=True)), ['regional_compile', 'layer_cls']),
])
@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_a_misconfigured_option_is_refused_naming_it(wrapper, options, fragments):
    from mmfsdp.wrappers.builder import resolve_wrapper
    cfg = dict(WRAPPERS[wrapper], **options)
    with pytest.raises((TypeError, ValueError)) as error:
        resolve_wrapper(cfg)
    for fragment in fragments:
        assert fragment in str(error.value)
