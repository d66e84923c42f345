"""Regional compile and the activation-checkpointing modes train what eager training trains.

``regional_compile=dict(layer_cls=[...])`` compiles each named layer on its
own (mmengine's ``compile`` compiles the whole ``train_step``);
``activation_checkpointing`` recomputes activations fully, selectively (matrix
products kept) or within a memory budget (the compiler decides; needs compiled
layers). Under FSDP1, FSDP2 and DDP at 2 ranks, every combination trains equal
to one eager process of mmengine's stock ``Runner`` on the global batch, and a
run resumed from its checkpoint ends exactly where the uninterrupted run ends.
"""
import pytest
import torch

from harness import max_abs_diff, run_distributed
from toy import (
    WRAPPERS,
    checkpointing_config,
    runner_config,
    train_one_process,
)

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

TOL = 1e-5
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


@pytest.fixture(scope='module')
def one_process(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp('one')
    cfg = runner_config('one', str(root), launcher='none', batch_size=GLOBAL_BATCH,
                        max_iters=ITERS)
    return train_one_process(cfg)['state']


@pytest.mark.parametrize('wrapper,combination', CASES + [INDUCTOR] + WHOLE_STEP)
def test_trains_equal_to_one_eager_process(runs, one_process, wrapper, combination):
    diff = max_abs_diff(runs[wrapper, combination]['state'], one_process)
    print(f'{wrapper} {combination}: max abs diff {diff:.2e}')
    assert diff <= TOL


@pytest.mark.parametrize('wrapper,combination', CASES + [INDUCTOR] + WHOLE_STEP)
def test_resumes_exactly(runs, wrapper, combination):
    run = runs[wrapper, combination]
    assert max_abs_diff(run['resumed'], run['state']) == 0


@pytest.mark.parametrize('wrapper,combination',
                         [c for c in CASES if 'compile' in c[1]] + WHOLE_STEP)
def test_the_named_layers_are_compiled(runs, wrapper, combination):
    run = runs[wrapper, combination]
    # 3 blocks x (4 iterations + 2 resumed), as graph pieces where the wrapper's hooks break it
    assert run['compiled_calls'] >= 3 * (ITERS + ITERS - INTERVAL)
