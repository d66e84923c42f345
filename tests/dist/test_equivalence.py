"""Two processes under FSDPRunner train exactly what one process trains.

Every scenario runs in one 2-process gloo group (starting interpreters is the
cost); each is compared with mmengine's *stock* ``Runner`` training the same
global batch in this process, without any mmfsdp code.
"""
import copy
import math

import pytest
import torch
from mmengine.config import Config

from harness import max_abs_diff, run_distributed, scalar_history
from toy import runner_config, saved_activation_bytes, train_one_process

TOL = 2e-5
FSDP = 'mmfsdp.MMFullyShardedDataParallel'
DDP = 'mmfsdp.MMDistributedDataParallel'
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
PER_RANK_BATCH = 4
WORLD_SIZE = 2

ADAMW = dict(optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.0))
CLIP = dict(optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=0.05))
ACCUMULATE = dict(optimizer=dict(type='AdamW', lr=1e-2), accumulative_counts=2)
PARAMWISE = dict(optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.5),
                 paramwise_cfg=dict(norm_decay_mult=0.0, flat_decay_mult=0.0,
                                    custom_keys={'head': dict(lr_mult=0.1)}))

#: name -> (model_wrapper_cfg, optim_wrapper, extra runner_config arguments)
SCENARIOS = {
    'full_shard/size_based': (dict(type=FSDP, auto_wrap_policy=dict(
        type='size_based', min_num_params=200)), ADAMW, {}),
    'full_shard/transformer': (dict(type=FSDP, auto_wrap_policy=BLOCKS), ADAMW, {}),
    'shard_grad_op/transformer': (dict(type=FSDP, sharding_strategy='shard_grad_op',
                                       auto_wrap_policy=BLOCKS), ADAMW, {}),
    'no_shard/transformer': (dict(type=FSDP, sharding_strategy='NO_SHARD',
                                  auto_wrap_policy=BLOCKS), ADAMW, {}),
    'full_shard/clip_grad': (dict(type=FSDP, auto_wrap_policy=BLOCKS), CLIP, {}),
    'full_shard/accumulate': (dict(type=FSDP, auto_wrap_policy=BLOCKS), ACCUMULATE,
                              dict(max_iters=12)),
    'full_shard/paramwise_cfg': (dict(type=FSDP, auto_wrap_policy=BLOCKS), PARAMWISE, {}),
    'full_shard/activation_checkpointing': (dict(
        type=FSDP, auto_wrap_policy=BLOCKS,
        activation_checkpointing=dict(layer_cls=['ToyBlock'])), ADAMW, {}),
    'ddp': (dict(type=DDP), ADAMW, {}),
    'ddp/clip_grad': (dict(type=DDP), CLIP, {}),
    'ddp/accumulate': (dict(type=DDP), ACCUMULATE, dict(max_iters=12)),
    # DDP's static graph asserts if the first iteration skips synchronisation
    'ddp/static_graph_accumulate': (dict(type=DDP, static_graph=True), ACCUMULATE,
                                    dict(max_iters=12)),
    'ddp/paramwise_cfg': (dict(type=DDP), PARAMWISE, {}),
}
EVAL_SCENARIOS = {
    'full_shard/val_test': dict(type=FSDP, auto_wrap_policy=BLOCKS),
    'ddp/val_test': dict(type=DDP),
}
BF16 = dict(type=FSDP, auto_wrap_policy=BLOCKS,
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32'))


def _reference_batch(optim_wrapper: dict) -> int:
    """The single process sees the global batch of one optimizer step."""
    return PER_RANK_BATCH * WORLD_SIZE * optim_wrapper.get('accumulative_counts', 1)


def _reference_iters(optim_wrapper: dict, extra: dict) -> int:
    return extra.get('max_iters', 6) // optim_wrapper.get('accumulative_counts', 1)


def _param_groups(runner) -> list:
    """(names, lr, weight_decay) of every optimizer group, names unwrapped."""
    from mmfsdp.names import unwrapped_param_names
    names = unwrapped_param_names(runner.model)
    return sorted((sorted(names[id(p)] for p in g['params']), g['lr'], g['weight_decay'])
                  for g in runner.optim_wrapper.optimizer.param_groups)


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone().float() for k, v in state.items()}


def _train_all(work_root: str) -> dict:
    import mmfsdp  # noqa: F401  (registers the 'mmfsdp.' names)
    from mmfsdp import FSDPRunner, MMFullyShardedDataParallel
    results = {}
    for name, (wrapper, optim, extra) in SCENARIOS.items():
        cfg = runner_config(name.replace('/', '-'), f'{work_root}/{name}', wrapper=wrapper,
                            batch_size=PER_RANK_BATCH, optim_wrapper=optim, **extra)
        runner = FSDPRunner.from_cfg(Config(cfg))
        runner.train()
        results[name] = dict(state=_full_state(runner.model), groups=_param_groups(runner),
                             grad_norm=scalar_history(runner, 'train/grad_norm'))
    for name, wrapper in EVAL_SCENARIOS.items():
        cfg = runner_config(name.replace('/', '-'), f'{work_root}/{name}', wrapper=wrapper,
                            batch_size=PER_RANK_BATCH, optim_wrapper=ADAMW, val=True,
                            max_iters=4)
        runner = FSDPRunner.from_cfg(Config(cfg))
        runner.train()
        results[name] = dict(val=runner.val(), test=runner.test())
    cfg = runner_config('bf16', f'{work_root}/bf16', wrapper=BF16, batch_size=PER_RANK_BATCH,
                        max_iters=30)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    results['bf16'] = dict(loss=scalar_history(runner, 'train/loss'),
                           dtypes=sorted({str(p.dtype) for p in runner.model.parameters()}))
    results['activation_bytes'] = {
        name: saved_activation_bytes(MMFullyShardedDataParallel, checkpoint)
        for name, checkpoint in (('plain', False), ('checkpointed', True))}
    return results if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def distributed(tmp_path_factory) -> dict:
    return run_distributed(_train_all, WORLD_SIZE, str(tmp_path_factory.mktemp('dist')))[0]


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """Single-process runs with mmengine's stock Runner, memoised per setting."""
    cache = {}
    root = tmp_path_factory.mktemp('ref')

    def run(optim_wrapper: dict, extra: dict, val: bool = False):
        key = repr((optim_wrapper, extra, val))
        if key not in cache:
            # One step of the whole global batch instead of accumulated micro-steps.
            single = {k: v for k, v in optim_wrapper.items() if k != 'accumulative_counts'}
            cfg = runner_config(f'ref{len(cache)}', str(root / str(len(cache))), launcher='none',
                                batch_size=_reference_batch(optim_wrapper),
                                optim_wrapper=copy.deepcopy(single), val=val,
                                max_iters=4 if val else _reference_iters(optim_wrapper, extra))
            cache[key] = train_one_process(cfg, val)
        return cache[key]

    return run


@pytest.mark.parametrize('name', list(SCENARIOS))
def test_final_weights_equal_one_process(name, distributed, reference):
    wrapper, optim, extra = SCENARIOS[name]
    diff = max_abs_diff(distributed[name]['state'], reference(optim, extra)['state'])
    print(f'{name}: max abs diff {diff:.2e}')
    assert diff <= TOL


@pytest.mark.parametrize('name', ['full_shard/clip_grad', 'ddp/clip_grad'])
def test_clipping_uses_the_global_gradient_norm(name, distributed, reference):
    wrapper, optim, extra = SCENARIOS[name]
    logged = distributed[name]['grad_norm']
    expected = reference(optim, extra)['grad_norm']
    assert len(logged) == len(expected) == 6
    assert logged == pytest.approx(expected, rel=1e-4)
    assert min(expected) > optim['clip_grad']['max_norm']  # clipping was active


@pytest.mark.parametrize('name', ['full_shard/paramwise_cfg', 'ddp/paramwise_cfg'])
def test_param_groups_equal_the_unwrapped_models(name, distributed, reference):
    wrapper, optim, extra = SCENARIOS[name]
    ref_runner = reference(optim, extra)['runner']
    assert distributed[name]['groups'] == _param_groups(ref_runner)
    decays = {wd for _, _, wd in distributed[name]['groups']}
    assert decays == {0.0, 0.5}  # norms and biases without decay, weight matrices with


def test_bf16_mixed_precision_trains_on_cpu(distributed):
    loss = distributed['bf16']['loss']
    assert len(loss) == 30 and all(math.isfinite(v) for v in loss)
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    print(f'bf16 loss: first five {first:.3f}, last five {last:.3f}')
    assert last < 0.8 * first
    assert distributed['bf16']['dtypes'] == ['torch.float32']  # fp32 master weights


def test_activation_checkpointing_lowers_activation_memory(distributed):
    saved = distributed['activation_bytes']
    print(f'saved activations: {saved}')
    assert saved['checkpointed'] < 0.5 * saved['plain']


@pytest.mark.parametrize('name', list(EVAL_SCENARIOS))
def test_val_and_test_metrics_equal_one_process(name, distributed, reference):
    ref = reference(ADAMW, dict(max_iters=4), val=True)
    for loop in ('val', 'test'):
        got, expected = distributed[name][loop], ref[loop]
        assert sorted(got) == sorted(expected) == ['accuracy', 'nll']
        assert got['nll'] == pytest.approx(expected['nll'], abs=TOL)
        assert got['accuracy'] == expected['accuracy']
