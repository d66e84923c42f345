"""A bad config fails on every rank at once, with an error naming key, value and choices.

All checks run in one 2-process group. Errors that need only the config are
raised before the process group exists; errors that need the model (a layer
class it lacks) are raised while wrapping, before any collective of FSDP.
"""
import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from harness import DIST_CFG, raised, run_distributed
from toy import runner_config

FSDP = 'mmfsdp.MMFullyShardedDataParallel'
DDP = 'mmfsdp.MMDistributedDataParallel'
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])

#: name -> (model_wrapper_cfg, error type, fragments the message must contain)
CONFIG_ERRORS = {
    'unknown wrapper type': (dict(type='mmfsdp.MMFullyShardedDataParalel'), KeyError, [
        'model_wrapper_cfg.type', "'mmfsdp.MMFullyShardedDataParalel'",
        "did you mean 'mmfsdp.MMFullyShardedDataParallel'", 'mmfsdp.MMDistributedDataParallel']),
    'sharding_strategy typo': (dict(type=FSDP, sharding_strategy='FULLSHARD'), ValueError, [
        'sharding_strategy', "'FULLSHARD'", "'FULL_SHARD'", "'SHARD_GRAD_OP'"]),
    'backward_prefetch': (dict(type=FSDP, backward_prefetch='middle'), ValueError, [
        'backward_prefetch', "'middle'", "'pre'", "'post'"]),
    'dtype typo': (dict(type=FSDP, mixed_precision=dict(param_dtype='bf17')), ValueError, [
        'mixed_precision.param_dtype', "'bf17'", "'bf16'", "'float32'"]),
    'mixed precision key': (dict(type=FSDP, mixed_precision=dict(compute_dtype='bf16')),
                            TypeError, ['mixed_precision', "'compute_dtype'", "'param_dtype'"]),
    'cpu_offload string': (dict(type=FSDP, cpu_offload='yes'), TypeError, [
        'cpu_offload', "'yes'", 'True/False', 'offload_params']),
    'unknown FSDP keyword': (dict(type=FSDP, use_orig_param=False), TypeError, [
        'model_wrapper_cfg', "'use_orig_param'", "'sharding_strategy'"]),
    'unknown DDP keyword': (dict(type=DDP, find_unused_parameter=True), TypeError, [
        'model_wrapper_cfg', "'find_unused_parameter'", "'find_unused_parameters'"]),
    # Without a scope the bare name is mmengine's wrapper: refused, naming ours.
    "mmengine's FSDP wrapper": (dict(type='MMFullyShardedDataParallel', auto_wrap_policy=BLOCKS),
                                ValueError, ['model_wrapper_cfg.type',
                                             "'MMFullyShardedDataParallel'", "mmengine's",
                                             "type='mmfsdp.MMFullyShardedDataParallel'"]),
}
#: Errors about what the machine cannot do; checked only on a CPU-only machine.
CPU_ONLY = torch.accelerator.current_accelerator(check_available=True) is None
CPU_ERRORS = {
    'FSDP1 cpu_offload on the CPU': (dict(type=FSDP, cpu_offload=True), ValueError, [
        'model_wrapper_cfg.cpu_offload', 'accelerator', 'cpu_offload=False']),
}
#: name -> (extra config keys, error type, fragments): start-up checks outside the wrapper.
START_UP_ERRORS = {
    'torchrun without --launcher': (dict(launcher='none'), ValueError, [
        "launcher: 'none'", 'WORLD_SIZE=2', '--launcher pytorch']),
    'whole-step and regional compile': (dict(compile=True, model_wrapper_cfg=dict(
        type=DDP, regional_compile=dict(layer_cls=['ToyBlock']))), ValueError, [
        'compile=True', 'model_wrapper_cfg.regional_compile', 'keep one']),
}
CPU_START_UP_ERRORS = {
    'nccl on a CPU-only machine': (dict(env_cfg=dict(dist_cfg=dict(backend='nccl', timeout=60))),
                                   ValueError, ["env_cfg.dist_cfg.backend: 'nccl'", 'CUDA',
                                                'env_cfg.dist_cfg.backend=gloo']),
}
MODEL_ERRORS = {
    'unknown policy': (dict(type=FSDP, auto_wrap_policy=dict(type='blocks')), KeyError, [
        'auto_wrap_policy.type', "'blocks'", 'transformer', 'size_based']),
    'layer_cls absent': (dict(type=FSDP, auto_wrap_policy=dict(
        type='transformer', layer_cls=['ToyBlk'])), ValueError, [
            'auto_wrap_policy.layer_cls', "'ToyBlk'", 'ToyBlock']),
    'min_num_params=0': (dict(type=FSDP, auto_wrap_policy=dict(
        type='size_based', min_num_params=0)), ValueError, [
            'auto_wrap_policy.min_num_params', '0']),
    'checkpoint layer absent': (dict(type=FSDP, auto_wrap_policy=BLOCKS,
                                     activation_checkpointing=dict(layer_cls=['Block'])),
                                ValueError, ['activation_checkpointing.layer_cls', "'Block'"]),
    'compiled layer absent': (dict(type=DDP, regional_compile=dict(layer_cls=['Block'])),
                              ValueError, ['regional_compile.layer_cls', "'Block'", 'ToyBlock']),
}


def _checks(work_root: str) -> dict:
    import mmfsdp  # noqa: F401
    from mmfsdp import FSDPRunner
    from mmfsdp.dist import init_distributed
    out = {}

    def build(name, wrapper, runner_cls=FSDPRunner, **extra):
        cfg = runner_config(name.replace(' ', '_'), f'{work_root}/{name}', batch_size=4,
                            wrapper=wrapper)
        cfg.update(extra)
        return runner_cls.from_cfg(Config(cfg))

    config_errors = dict(CONFIG_ERRORS, **(CPU_ERRORS if CPU_ONLY else {}))
    for name, (wrapper, _, _) in config_errors.items():
        out[name] = raised(lambda n=name, w=wrapper: build(n, w)) + (
            torch.distributed.is_initialized(), )
    start_up_errors = dict(START_UP_ERRORS, **(CPU_START_UP_ERRORS if CPU_ONLY else {}))
    for name, (extra, _, _) in start_up_errors.items():
        out[name] = raised(lambda n=name, e=extra: build(n, dict(type=DDP), **e)) + (
            torch.distributed.is_initialized(), )
    for name, (wrapper, _, _) in MODEL_ERRORS.items():
        out[name] = raised(lambda n=name, w=wrapper: build(n, w)) + (None, )

    # mmengine's stock Runner: start the group first (its init_dist needs CUDA)
    if not torch.distributed.is_initialized():
        init_distributed('pytorch', DIST_CFG)
    wrapper = dict(type=FSDP, auto_wrap_policy=BLOCKS)
    out['stock runner'] = raised(lambda: build('stock', wrapper, Runner))

    wrapper = dict(type=DDP)
    cfg = runner_config('stock-ddp', f'{work_root}/stock-ddp', batch_size=4, wrapper=wrapper)
    runner = Runner.from_cfg(Config(cfg))
    runner.train()
    out['stock runner ddp'] = {k: v.detach().clone() for k, v in
                               runner.model.module.state_dict().items()}
    out['stock runner ddp type'] = type(runner.model).__name__

    # mmengine's DDP wrapper (the bare name) is accepted by FSDPRunner and trains like ours.
    cfg = runner_config('mmengine-ddp', f'{work_root}/mmengine-ddp', batch_size=4,
                        wrapper=dict(type='MMDistributedDataParallel'))
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    out['mmengine ddp'] = {k: v.detach().clone() for k, v in
                           runner.model.module.state_dict().items()}
    out['mmengine ddp type'] = type(runner.model).__module__

    wrapper = dict(type=FSDP, auto_wrap_policy=BLOCKS, mixed_precision=dict(param_dtype='fp32'))
    cfg = runner_config('unchanged', f'{work_root}/unchanged', batch_size=4, wrapper=wrapper,
                        max_iters=1)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    out['config after training'] = runner.cfg.model_wrapper_cfg.to_dict()
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_checks, 2, str(tmp_path_factory.mktemp('fail')))


def _assert_same_error_on_every_rank(ranks, name, error, fragments):
    assert {r[name][0] for r in ranks} == {error.__name__}, ranks[0][name]
    assert len({r[name][1] for r in ranks}) == 1
    message = ranks[0][name][1]
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize('name', list(CONFIG_ERRORS))
def test_config_error_is_raised_before_the_process_group_starts(ranks, name):
    _, error, fragments = CONFIG_ERRORS[name]
    _assert_same_error_on_every_rank(ranks, name, error, fragments)
    assert [r[name][2] for r in ranks] == [False, False]  # no collective was ever possible


@pytest.mark.skipif(not CPU_ONLY, reason='checks what a CPU-only machine cannot do')
@pytest.mark.parametrize('name', list(CPU_ERRORS))
def test_what_the_cpu_cannot_do_is_refused_before_the_process_group_starts(ranks, name):
    _, error, fragments = CPU_ERRORS[name]
    _assert_same_error_on_every_rank(ranks, name, error, fragments)
    assert [r[name][2] for r in ranks] == [False, False]


@pytest.mark.parametrize('name', list(START_UP_ERRORS))
def test_start_up_mistake_is_refused_on_every_rank_before_the_process_group(ranks, name):
    _, error, fragments = START_UP_ERRORS[name]
    _assert_same_error_on_every_rank(ranks, name, error, fragments)
    assert [r[name][2] for r in ranks] == [False, False]


@pytest.mark.skipif(not CPU_ONLY, reason='checks what a CPU-only machine cannot do')
@pytest.mark.parametrize('name', list(CPU_START_UP_ERRORS))
def test_nccl_on_a_cpu_only_machine_names_the_config_key(ranks, name):
    _, error, fragments = CPU_START_UP_ERRORS[name]
    _assert_same_error_on_every_rank(ranks, name, error, fragments)
    assert [r[name][2] for r in ranks] == [False, False]


def test_mmengine_ddp_wrapper_trains_under_fsdp_runner_like_ours(ranks):
    assert ranks[0]['mmengine ddp type'] == 'mmengine.model.wrappers.distributed'
    expected = ranks[0]['stock runner ddp']  # mmfsdp's DDP wrapper, same run
    for rank in ranks:
        got = rank['mmengine ddp']
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) == 0


@pytest.mark.parametrize('name', list(MODEL_ERRORS))
def test_model_dependent_error_is_raised_on_every_rank(ranks, name):
    _, error, fragments = MODEL_ERRORS[name]
    _assert_same_error_on_every_rank(ranks, name, error, fragments)


def test_fsdp_wrapper_under_stock_runner_names_fsdp_runner(ranks):
    _assert_same_error_on_every_rank(ranks, 'stock runner', RuntimeError,
                                     ["runner_type='mmfsdp.FSDPRunner'"])


def test_ddp_sibling_trains_under_stock_runner_like_one_process(ranks, tmp_path):
    assert ranks[0]['stock runner ddp type'] == 'MMDistributedDataParallel'
    cfg = runner_config('ref', str(tmp_path), batch_size=8, launcher='none')
    reference = Runner.from_cfg(Config(cfg))
    reference.train()
    expected = reference.model.state_dict()
    for rank in ranks:
        got = rank['stock runner ddp']
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 2e-5


def test_training_leaves_the_wrapper_config_unchanged(ranks):
    assert ranks[0]['config after training'] == dict(
        type=FSDP, auto_wrap_policy=BLOCKS, mixed_precision=dict(param_dtype='fp32'))
