"""Regional compile and the activation-checkpointing modes train what eager training trains.

``regional_compile=dict(layer_cls=[...])`` compiles each named layer on its
own (mmengine's ``compile`` compiles the whole ``train_step``);
``activation_checkpointing`` recomputes activations fully, selectively (matrix
products kept) or within a memory budget (the compiler decides; needs compiled
layers). Under FSDP1, FSDP2 and DDP at 2 ranks, every combination trains equal
to one eager process of mmengine's stock ``Runner`` on the global batch, and a
run resumed from its checkpoint ends exactly where the uninterrupted run ends.
The unit checks (no process) show what each mode keeps.
"""
import pytest
import torch

from harness import max_abs_diff, run_distributed
from toy import (
    IN_DIM,
    WRAPPERS,
    ToyClassifier,
    checkpointing_config,
)

GLOBAL_BATCH, ITERS, INTERVAL = 8, 4, 2
BLOCK = ['ToyBlock']
#: Compiled through AOTAutograd without code generation (seconds, not minutes, per graph);
#: the graphs are counted, so a layer that is not compiled fails the test.
BACKEND = 'aot_eager_counted'
COMPILE = dict(layer_cls=BLOCK, backend=BACKEND)
#: name -> the layer options added to each wrapper's config. The memory budget is a
#: process-wide torch setting, so its combination runs last.
COMBINATIONS = {
    'compile': dict(regional_compile=COMPILE),
    'compile+full': dict(regional_compile=COMPILE,
                         activation_checkpointing=dict(layer_cls=BLOCK)),
    'compile+selective': dict(regional_compile=COMPILE,
                              activation_checkpointing=dict(layer_cls=BLOCK, mode='selective')),
    'selective': dict(activation_checkpointing=dict(layer_cls=BLOCK, mode='selective')),
    'compile+memory_budget': dict(regional_compile=COMPILE, activation_checkpointing=dict(
        mode='memory_budget', memory_budget=0.0)),
}
CASES = [(w, c) for c in COMBINATIONS for w in WRAPPERS]
#: torch.compile's default backend (inductor: generated C++ on the CPU), once.
INDUCTOR = ('fsdp2', 'inductor+selective')
INDUCTOR_OPTIONS = dict(regional_compile=dict(layer_cls=BLOCK), activation_checkpointing=dict(
    layer_cls=BLOCK, mode='selective'))
#: mmengine's own ``compile`` (the whole ``train_step``).
WHOLE_STEP = [('fsdp2', 'whole-step compile')]
#: Calls of compiled graphs that hold a linear layer (a block's), in this process.
CALLS = [0]


def _register_counting_backend() -> None:
    from torch._dynamo import lookup_backend, register_backend

    @register_backend(name=BACKEND)
    def aot_eager_counted(graph, example_inputs):
        compiled = lookup_backend('aot_eager')(graph, example_inputs)
        nodes = [node for module in graph.modules() for node in module.graph.nodes]
        if not any('linear' in str(node.target) for node in nodes):
            return compiled

        def counted(*args):
            CALLS[0] += 1
            return compiled(*args)
        return counted


def _state(runner) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(runner.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _train_all(root: str) -> dict:
    import mmfsdp  # noqa: F401
    from mmfsdp import FSDPRunner
    _register_counting_backend()
    out = {}
    cases = [(w, c, dict(WRAPPERS[w], **COMBINATIONS[c])) for w, c in CASES[:-3]]
    cases.append((*INDUCTOR, dict(WRAPPERS[INDUCTOR[0]], **INDUCTOR_OPTIONS)))
    cases += [(w, c, WRAPPERS[w]) for w, c in WHOLE_STEP]
    cases += [(w, c, dict(WRAPPERS[w], **COMBINATIONS[c])) for w, c in CASES[-3:]]
    for wrapper_name, combination, wrapper in cases:
        work_dir = f'{root}/{wrapper_name}-{combination}'
        calls = CALLS[0]
        extra = dict(compile=dict(backend=BACKEND)) if 'whole-step' in combination else {}
        cfg = checkpointing_config(work_dir, wrapper, 2, global_batch=GLOBAL_BATCH,
                                   max_iters=ITERS, interval=INTERVAL, **extra)
        runner = FSDPRunner.from_cfg(cfg)
        runner.train()
        uninterrupted = _state(runner)
        cfg = checkpointing_config(f'{work_dir}-resumed', wrapper, 2, global_batch=GLOBAL_BATCH,
                                   max_iters=ITERS, interval=INTERVAL,
                                   resume_from=f'{work_dir}/iter_{INTERVAL}.pth', **extra)
        runner = FSDPRunner.from_cfg(cfg)
        runner.train()
        out[wrapper_name, combination] = dict(
            state=uninterrupted, resumed=_state(runner), compiled_calls=CALLS[0] - calls)
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    return run_distributed(_train_all, 2, str(tmp_path_factory.mktemp('layers')), timeout=600)[0]


# ---- what each mode keeps (one process, no process group) --------------------------------

def _prepared(**options) -> torch.nn.Module:
    """The toy model with its layers checkpointed / compiled as FSDP2 would, before sharding."""
    from mmfsdp.layers import prepare_layers
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
