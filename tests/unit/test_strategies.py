"""FlexibleRunner strategies translated into mmfsdp's keys (no process).

The strategy dicts are the shipped ones, written here literally: mmpretrain 1.2.0's
``configs/mae/benchmarks/vit-large-p16_8xb128-{fsdp,ds,ds-zero3}-coslr-50e_in1k.py`` and
mmdetection's ``projects/example_largemodel/dino-5scale_swin-l_{fsdp,deepspeed}_8xb2-12e_coco.py``.
The multi-rank runs that train them sharded are ``tests/dist/test_strategies.py``.
"""
import copy
import json

import pytest
import torch
from mmengine._strategy import DeepSpeedStrategy as MMEngineDeepSpeedStrategy
from mmengine.config import Config
from mmengine.config.lazy import LazyObject
from mmengine.optim import OptimWrapper
from mmengine.registry import RUNNERS
from torch import nn

from mmfsdp import AmpOptimWrapper, FSDPRunner
from mmfsdp.dist import current_device
from mmfsdp.policies import build_wrap_policy, plan_units
from mmfsdp.strategies import translate_strategy
from mmfsdp.wrappers.builder import model_wrapper_config, resolve_wrapper
from toy import ToyClassifier, runner_config

# mmpretrain 1.2.0, vit-large-p16_8xb128-fsdp-coslr-50e_in1k.py
MMPRETRAIN_FSDP = dict(
    type='FSDPStrategy',
    model_wrapper=dict(
        auto_wrap_policy=dict(
            type='torch.distributed.fsdp.wrap.size_based_auto_wrap_policy',
            min_num_params=1e7)))
# mmpretrain 1.2.0, vit-large-p16_8xb128-ds-coslr-50e_in1k.py (the zero3 variant: stage=3)
MMPRETRAIN_DS = dict(
    type='DeepSpeedStrategy',
    fp16=dict(
        enabled=True,
        fp16_master_weights_and_grads=False,
        loss_scale=0,
        loss_scale_window=500,
        hysteresis=2,
        min_loss_scale=1,
        initial_scale_power=15,
    ),
    inputs_to_half=['inputs'],
    zero_optimization=dict(
        stage=1,
        allgather_partitions=True,
        reduce_scatter=True,
        allgather_bucket_size=50000000,
        reduce_bucket_size=50000000,
        overlap_comm=True,
        contiguous_gradients=True,
        cpu_offload=False,
    ))
# its optim_wrapper once merged with its base (vit-base-p16_8xb128-coslr-100e_in1k.py)
MMPRETRAIN_DS_OPTIM = dict(
    type='DeepSpeedOptimWrapper',
    optimizer=dict(type='AdamW', lr=4e-3, weight_decay=0.05, betas=(0.9, 0.999)),
    constructor='LearningRateDecayOptimWrapperConstructor',
    paramwise_cfg=dict(
        layer_decay_rate=0.75,
        custom_keys={
            '.ln': dict(decay_mult=0.0),
            '.bias': dict(decay_mult=0.0),
            '.cls_token': dict(decay_mult=0.0),
            '.pos_embed': dict(decay_mult=0.0)
        }))


def name_auto_wrap_policy(module, recurse: bool, nonwrapped_numel: int, layer_cls=None) -> bool:
    """The shape of mmdet's example policy (``projects/example_largemodel/utils.py``)."""
    return recurse or isinstance(module, nn.Linear)


# mmdet, dino-5scale_swin-l_fsdp_8xb2-12e_coco.py (a Python-style config)
MMDET_FSDP = dict(
    type='FSDPStrategy',
    model_wrapper=dict(
        auto_wrap_policy=dict(
            type=name_auto_wrap_policy)))
# mmdet, dino-5scale_swin-l_deepspeed_8xb2-12e_coco.py
MMDET_DS = dict(
    type='DeepSpeedStrategy',
    gradient_clipping=0.1,
    fp16=dict(
        enabled=True,
        fp16_master_weights_and_grads=False,
        loss_scale=0,
        loss_scale_window=500,
        hysteresis=2,
        min_loss_scale=1,
        initial_scale_power=15,
    ),
    inputs_to_half=['inputs'],
    zero_optimization=dict(
        stage=3,
        allgather_partitions=True,
        reduce_scatter=True,
        allgather_bucket_size=50000000,
        reduce_bucket_size=50000000,
        overlap_comm=True,
        contiguous_gradients=True,
        cpu_offload=False),
)
MMDET_DS_OPTIM = dict(
    type='DeepSpeedOptimWrapper',
    optimizer=dict(type='AdamW', lr=0.0001, weight_decay=0.0001),
    paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=0.1)}))


def _translate(strategy, **cfg):
    cfg = dict(cfg, strategy=strategy)
    before = copy.deepcopy(cfg)
    out = translate_strategy(cfg)
    assert cfg == before  # the user's config is never changed
    return out


def _sources(lines):
    return [line.split(' → ')[0].split('=')[0] for line in lines]


def test_mmpretrain_fsdp_strategy_is_fsdp2_with_the_size_based_policy():
    cfg = dict(strategy=MMPRETRAIN_FSDP, optim_wrapper=dict(type='AmpOptimWrapper'))
    out = _translate(**cfg)
    assert out.model_wrapper_cfg == dict(
        type='mmfsdp.MMFullyShard', auto_wrap_policy=dict(type='size_based', min_num_params=1e7))
    assert out.optim_wrapper == {}  # AmpOptimWrapper: replaced as ever
    # no state_dict_cfg: mmengine's default 'local', per-rank shards
    assert out.checkpoint == dict(state_dict_type='sharded')
    assert _sources(out.lines) == ['strategy.type', 'strategy.model_wrapper.auto_wrap_policy',
                                   'strategy.state_dict_cfg']
    # the place FSDPRunner and the plan CLI resolve the wrapper takes the strategy
    wrapping = resolve_wrapper(model_wrapper_config(cfg))
    assert wrapping.cls.__name__ == 'MMFullyShard'
    assert wrapping.config.auto_wrap_policy == dict(type='size_based', min_num_params=1e7)


def test_size_based_takes_an_integral_float_and_refuses_a_fraction():
    model = ToyClassifier(dim=16, depth=3)  # a block holds 1072 parameters
    assert plan_units(model, build_wrap_policy(dict(type='size_based', min_num_params=1e3),
                                               model)) == ['blocks.0', 'blocks.1', 'blocks.2']
    with pytest.raises(ValueError, match=r'auto_wrap_policy.min_num_params: expected a positive '
                       r'whole number of parameters, got 1500.5'):
        build_wrap_policy(dict(type='size_based', min_num_params=1500.5), model)


def test_fsdp_strategy_options_and_fsdp1_on_request():
    out = _translate(dict(
        type='FSDPStrategy', skip_init_weights=True, state_dict_cfg='local',
        model_wrapper=dict(type='MMFullyShardedDataParallel', use_orig_params=True,
                           sharding_strategy='SHARD_GRAD_OP',
                           mixed_precision=dict(param_dtype='bfloat16'),
                           auto_wrap_policy=dict(
                               type='torch.distributed.fsdp.wrap.transformer_auto_wrap_policy',
                               transformer_layer_cls={nn.Linear}))))
    assert out.model_wrapper_cfg == dict(
        type='mmfsdp.MMFullyShardedDataParallel', sharding_strategy='SHARD_GRAD_OP',
        mixed_precision=dict(param_dtype='bfloat16'), init_device='meta',
        auto_wrap_policy=dict(type='transformer', layer_cls={nn.Linear}))
    assert out.checkpoint == dict(state_dict_type='sharded')
    assert sorted(_sources(out.lines)) == sorted([
        'strategy.model_wrapper.type', 'strategy.model_wrapper.use_orig_params',
        'strategy.model_wrapper.sharding_strategy', 'strategy.model_wrapper.mixed_precision',
        'strategy.model_wrapper.auto_wrap_policy', 'strategy.skip_init_weights',
        'strategy.state_dict_cfg'])
    hooks = out.default_hooks(dict(checkpoint=dict(type='CheckpointHook', interval=5)))
    assert hooks['checkpoint'] == dict(type='CheckpointHook', interval=5,
                                       state_dict_type='sharded')
    assert out.default_hooks(None)['checkpoint']['state_dict_type'] == 'sharded'
    fsdp2 = _translate(dict(type='FSDPStrategy', state_dict_cfg=dict(
        state_dict_type='FULL_STATE_DICT'), model_wrapper=dict(cpu_offload=True)))
    assert fsdp2.model_wrapper_cfg == dict(type='mmfsdp.MMFullyShard',
                                           offload=dict(cpu_offload=True))
    assert fsdp2.checkpoint == dict(state_dict_type='full')


def test_mmdet_callable_policy_is_kept():
    out = _translate(MMDET_FSDP)
    assert out.model_wrapper_cfg['auto_wrap_policy'] is name_auto_wrap_policy
    model = ToyClassifier(dim=16, depth=1)
    wrapping = resolve_wrapper(model_wrapper_config(dict(strategy=MMDET_FSDP)))
    assert wrapping.layout(model).units == ('embed', 'blocks.0.fc1', 'blocks.0.fc2', 'head')


@pytest.mark.parametrize('stage, reshard', [(1, False), (3, True)])
def test_mmpretrain_deepspeed_strategy(stage, reshard):
    strategy = dict(MMPRETRAIN_DS, zero_optimization=dict(MMPRETRAIN_DS['zero_optimization'],
                                                          stage=stage))
    out = _translate(strategy, optim_wrapper=MMPRETRAIN_DS_OPTIM)
    assert out.model_wrapper_cfg == dict(type='mmfsdp.MMFullyShard',
                                         reshard_after_forward=reshard, auto_wrap_policy='auto')
    optim = out.optim_wrapper_cfg(MMPRETRAIN_DS_OPTIM)
    assert optim == dict(MMPRETRAIN_DS_OPTIM, type=AmpOptimWrapper, dtype='float16',
                         loss_scale=dict(init_scale=2.0**15, growth_interval=500))
    stage_line = next(line for line in out.lines if 'reshard_after_forward' in line)
    assert ('nearest' in stage_line) == (stage == 1)
    # every key of the strategy is in the log block once
    sources = set(_sources(out.lines))
    for key in ('inputs_to_half', 'zero_optimization.stage', 'zero_optimization.cpu_offload',
                'zero_optimization.overlap_comm', 'zero_optimization.reduce_bucket_size',
                'fp16.enabled', 'fp16.hysteresis', 'fp16.min_loss_scale',
                'fp16.fp16_master_weights_and_grads'):
        assert f'strategy.{key}' in sources, key
    assert out.log_block().count('\n') == len(out.lines)


def test_mmdet_deepspeed_strategy_clips_and_keeps_paramwise_cfg():
    out = _translate(MMDET_DS, optim_wrapper=MMDET_DS_OPTIM)
    assert out.model_wrapper_cfg['reshard_after_forward'] is True
    assert out.optim_wrapper_cfg(MMDET_DS_OPTIM) == dict(
        MMDET_DS_OPTIM, type=AmpOptimWrapper, dtype='float16', clip_grad=dict(max_norm=0.1),
        loss_scale=dict(init_scale=2.0**15, growth_interval=500))


def test_deepspeed_bf16_stage2_and_stage0():
    out = _translate(dict(type='DeepSpeedStrategy', bf16=dict(enabled=True),
                          zero_optimization=dict(stage=2), gradient_accumulation_steps=2),
                     optim_wrapper=dict(type='DeepSpeedOptimWrapper'))
    assert out.model_wrapper_cfg == dict(type='mmfsdp.MMFullyShard',
                                         reshard_after_forward=False, auto_wrap_policy='auto')
    assert out.optim_wrapper == dict(type=AmpOptimWrapper, dtype='bfloat16', accumulative_counts=2,
                                     loss_scale=dict(enabled=False))
    plain = _translate(dict(type='DeepSpeedStrategy'), optim_wrapper=dict(
        type='DeepSpeedOptimWrapper'))
    assert plain.model_wrapper_cfg == dict(type='mmfsdp.MMDistributedDataParallel')
    assert plain.optim_wrapper == dict(type=OptimWrapper)


@pytest.mark.parametrize('clipping', [0.0, 0])
def test_deepspeed_gradient_clipping_zero_is_no_clipping(clipping):
    # DeepSpeed's default is 0.0, meaning no clipping; max_norm=0 would zero every gradient
    out = _translate(dict(type='DeepSpeedStrategy', gradient_clipping=clipping),
                     optim_wrapper=dict(type='DeepSpeedOptimWrapper'))
    assert 'clip_grad' not in out.optim_wrapper_cfg(dict(type='DeepSpeedOptimWrapper'))
    assert f'strategy.gradient_clipping={clipping!r} → nothing to set' in out.log_block()
    clipped = _translate(dict(type='DeepSpeedStrategy', gradient_clipping=1.5))
    assert clipped.optim_wrapper['clip_grad'] == dict(max_norm=1.5)
    with pytest.raises(ValueError, match=r'strategy.gradient_clipping=-1.0 .* or 0 for no'):
        _translate(dict(type='DeepSpeedStrategy', gradient_clipping=-1.0))


def test_fsdp_strategy_without_state_dict_cfg_saves_per_rank_shards():
    # mmengine's FSDPStrategy defaults to state_dict_cfg='local': every rank saves its shards
    out = _translate(dict(type='FSDPStrategy'))
    assert out.checkpoint == dict(state_dict_type='sharded')
    assert "strategy.state_dict_cfg → default_hooks.checkpoint.state_dict_type='sharded' " \
        "(unset: mmengine's 'local', per-rank shards)" in out.lines
    assert _translate(dict(type='FSDPStrategy', state_dict_cfg='full')).checkpoint == dict(
        state_dict_type='full')
    # the config's own checkpoint hook format stands where the strategy names none
    own = _translate(dict(type='FSDPStrategy'), default_hooks=dict(checkpoint=dict(
        type='CheckpointHook', state_dict_type='full')))
    assert own.checkpoint == {}
    assert own.default_hooks(dict(checkpoint=dict(type='CheckpointHook', state_dict_type='full'))
                             )['checkpoint']['state_dict_type'] == 'full'


def test_mmengine_state_dict_cfg_dict_form_is_taken():
    # FSDPStrategy's docstring example, and its default state_dict_type without the key
    full = _translate(dict(type='FSDPStrategy', state_dict_cfg=dict(
        state_dict_type='FULL_STATE_DICT',
        state_dict_config=dict(type='FullStateDictConfig', offload_to_cpu=True),
        optim_state_dict_config=dict(type='FullOptimStateDictConfig', offload_to_cpu=True))))
    assert full.checkpoint == dict(state_dict_type='full')
    assert {'strategy.state_dict_cfg.state_dict_config',
            'strategy.state_dict_cfg.optim_state_dict_config'} <= set(_sources(full.lines))
    local = _translate(dict(type='FSDPStrategy', state_dict_cfg=dict(
        state_dict_config=dict(type='LocalStateDictConfig'))))
    assert local.checkpoint == dict(state_dict_type='sharded')


@pytest.mark.parametrize('wrapper', ['MMFullyShard', 'MMFullyShardedDataParallel'])
@pytest.mark.parametrize('cpu_offload, offloads', [
    (dict(offload_params=False), False), (dict(offload_params=True), True), (False, False),
    (True, True)])
def test_model_wrapper_cpu_offload_means_the_same_under_fsdp1_and_fsdp2(
        wrapper, cpu_offload, offloads):
    strategy = dict(type='FSDPStrategy', model_wrapper=dict(type=wrapper, cpu_offload=cpu_offload))
    wrapping = resolve_wrapper(model_wrapper_config(dict(strategy=strategy)))
    assert wrapping.config.offloads_to_cpu is offloads


def test_deepspeed_offload_keys_are_translated_logged_or_refused():
    zero = dict(stage=3, offload_param=dict(device='cpu', pin_memory=False, buffer_count=5),
                offload_optimizer=dict(device='cpu', pin_memory=False, ratio=1.0))
    out = _translate(dict(type='DeepSpeedStrategy', zero_optimization=zero))
    assert out.model_wrapper_cfg['offload'] == dict(cpu_offload=True, pin_memory=False)
    sources = _sources(out.lines)
    for key in ('offload_param', 'offload_param.pin_memory', 'offload_param.buffer_count',
                'offload_optimizer', 'offload_optimizer.pin_memory', 'offload_optimizer.ratio'):
        assert f'strategy.zero_optimization.{key}' in sources, key
    # a partial optimizer offload trains differently placed state: refused
    with pytest.raises(ValueError, match=r'offload_optimizer.ratio=0.3 .* whole optimizer state'):
        _translate(dict(type='DeepSpeedStrategy', zero_optimization=dict(
            stage=3, offload_optimizer=dict(device='cpu', ratio=0.3))))
    with pytest.raises(ValueError, match='offload_param.pin_memory and strategy.zero_optimizat'
                       'ion.offload_optimizer.pin_memory differ'):
        _translate(dict(type='DeepSpeedStrategy', zero_optimization=dict(
            stage=3, offload_param=dict(device='cpu', pin_memory=True),
            offload_optimizer=dict(device='cpu', pin_memory=False))))
    with pytest.raises(TypeError, match=r"offload_param: unknown key 'pinned_memory' \(did you "
                       r"mean 'pin_memory'\?\)"):
        _translate(dict(type='DeepSpeedStrategy', zero_optimization=dict(
            stage=3, offload_param=dict(device='cpu', pinned_memory=True))))


def test_activation_checkpointing_refusal_names_the_form_that_works():
    strategy = dict(type='FSDPStrategy', activation_checkpointing=dict(check_fn='f'))
    with pytest.raises(ValueError) as e:
        _translate(strategy)
    assert 'write strategy.model_wrapper.activation_checkpointing=dict(layer_cls=[...])' in \
        str(e.value)
    works = dict(type='FSDPStrategy', model_wrapper=dict(
        activation_checkpointing=dict(layer_cls=['ToyBlock'])))
    wrapping = resolve_wrapper(model_wrapper_config(dict(strategy=works)))
    assert wrapping.config.activation_checkpointing.layer_cls == ('ToyBlock', )
    # DeepSpeed's section configures deepspeed.checkpointing, which only the model calls
    ds = _translate(dict(type='DeepSpeedStrategy', activation_checkpointing=dict(
        partition_activations=True)))
    assert 'strategy.activation_checkpointing' in _sources(ds.lines)
    assert ds.model_wrapper_cfg == dict(type='mmfsdp.MMDistributedDataParallel')


@pytest.mark.parametrize('kind, nones', [
    ('FSDPStrategy', 'activation_checkpointing env_kwargs log_kwargs experiment_name '
                     'auto_scale_lr sync_bn model_wrapper state_dict_cfg'),
    ('DeepSpeedStrategy', 'config amp aio activation_checkpointing exclude_frozen_parameters '
                          'zero_optimization gradient_clipping fp16 bf16 inputs_to_half '
                          'train_micro_batch_size_per_gpu gradient_accumulation_steps '
                          'env_kwargs log_kwargs experiment_name')])
def test_keys_at_mmengines_none_default_are_unset(kind, nones):
    out = _translate(dict(dict.fromkeys(nones.split()), type=kind))
    bare = _translate(dict(type=kind))
    assert (out.model_wrapper_cfg, out.optim_wrapper, out.checkpoint) == (
        bare.model_wrapper_cfg, bare.optim_wrapper, bare.checkpoint)
    assert "strategy.env_kwargs=None → nothing to set (mmengine's default, unset)" in out.lines


def test_fsdp1_device_id_of_this_process_is_accepted():
    # mmengine's FSDPStrategy passes device_id=LOCAL_RANK; on a CPU host it must be the CPU
    here = current_device()
    out = _translate(dict(type='FSDPStrategy', model_wrapper=dict(
        type='MMFullyShardedDataParallel', device_id=here)))
    assert 'device_id' not in out.model_wrapper_cfg
    assert 'strategy.model_wrapper.device_id' in _sources(out.lines)
    with pytest.raises(ValueError, match=r"strategy.model_wrapper.device_id=device\(type='meta'\)"
                       f' .* this process trains on {here}'):
        _translate(dict(type='FSDPStrategy', model_wrapper=dict(device_id=torch.device('meta'))))


@pytest.mark.parametrize('cfg, error, words', [
    (dict(strategy=MMPRETRAIN_FSDP, model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard')),
     ValueError, ['strategy and model_wrapper_cfg']),
    (dict(strategy=dict(type='ColossalAIStrategy')), KeyError,
     ["strategy.type: 'ColossalAIStrategy'", 'FSDPStrategy']),
    (dict(strategy=dict(MMPRETRAIN_FSDP, skip_init_weight=True)), TypeError,
     ["unknown key 'skip_init_weight'", "did you mean 'skip_init_weights'"]),
    (dict(strategy=dict(MMPRETRAIN_FSDP, activation_checkpointing=dict(check_fn='f'))),
     ValueError, ['strategy.activation_checkpointing=',
                  'strategy.model_wrapper.activation_checkpointing=dict(layer_cls=[...])']),
    (dict(strategy=dict(MMPRETRAIN_FSDP, work_dir='w')), ValueError,
     ["strategy.work_dir='w'", 'config key work_dir']),
    (dict(strategy=dict(type='FSDPStrategy', model_wrapper=dict(param_init_fn=print))),
     ValueError, ['strategy.model_wrapper.param_init_fn=', 'skip_init_weights']),
    (dict(strategy=dict(type='FSDPStrategy', model_wrapper=dict(type='MMDDP'))), ValueError,
     ["strategy.model_wrapper.type: 'MMDDP'"]),
    (dict(strategy=dict(type='FSDPStrategy', model_wrapper=dict(auto_wrap_policy='nope'))),
     KeyError, ["strategy.model_wrapper.auto_wrap_policy: 'nope'"]),
    (dict(strategy=dict(type='FSDPStrategy', state_dict_cfg='full'),
          default_hooks=dict(checkpoint=dict(type='CheckpointHook', state_dict_type='full'))),
     ValueError, ['state_dict_cfg and default_hooks.checkpoint.state_dict_type']),
    (dict(strategy=dict(type='FSDPStrategy', state_dict_cfg=dict(
        state_dict_type='FULL_STATE_DICT', offload_to_cpu=True))),
     TypeError, ["strategy.state_dict_cfg: unknown key 'offload_to_cpu'"]),
    (dict(strategy=dict(type='FSDPStrategy', state_dict_cfg='everything')), ValueError,
     ["strategy.state_dict_cfg: 'everything'", "'local'"]),
    (dict(optim_wrapper=dict(type='DeepSpeedOptimWrapper')), ValueError,
     ["optim_wrapper.type='DeepSpeedOptimWrapper'", 'DeepSpeedStrategy']),
    (dict(strategy=dict(type='DeepSpeedStrategy', zero_optimization=dict(stage=4))), ValueError,
     ['strategy.zero_optimization.stage: 4']),
    (dict(strategy=dict(type='DeepSpeedStrategy', zero_optimization=dict(stage=3, foo=1))),
     TypeError, ["strategy.zero_optimization: unknown key 'foo'"]),
    (dict(strategy=dict(type='DeepSpeedStrategy', zero_optimization=dict(
        stage=3, offload_param=dict(device='nvme')))), ValueError,
     ["strategy.zero_optimization.offload_param.device='nvme'"]),
    (dict(strategy=dict(type='DeepSpeedStrategy', fp16=dict(enabled=True),
                        bf16=dict(enabled=True))), ValueError, ['fp16 and strategy.bf16']),
    (dict(strategy=dict(type='DeepSpeedStrategy', fp16=dict(
        enabled=True, fp16_master_weights_and_grads=True))), ValueError,
     ['strategy.fp16.fp16_master_weights_and_grads=True']),
    (dict(strategy=dict(type='DeepSpeedStrategy', inputs_to_half=['inputs'])), ValueError,
     ['strategy.inputs_to_half=']),
    (dict(strategy=dict(type='DeepSpeedStrategy', gradient_clipping=1.0),
          optim_wrapper=dict(type='DeepSpeedOptimWrapper', clip_grad=dict(max_norm=1.0))),
     ValueError, ['strategy.gradient_clipping and optim_wrapper.clip_grad']),
    (dict(strategy=dict(type='DeepSpeedStrategy', train_micro_batch_size_per_gpu=8),
          train_dataloader=dict(batch_size=4)), ValueError,
     ['train_micro_batch_size_per_gpu=8', 'batch_size=4']),
    (dict(strategy=dict(type='DeepSpeedStrategy', config='ds.json')), ValueError,
     ["strategy.config='ds.json'"]),
    (dict(strategy=dict(type='DeepSpeedStrategy', fp16=dict(enabled=True)),
          optim_wrapper=dict(type='OptimWrapper')),
     ValueError, ['strategy.fp16.enabled=True', "optim_wrapper.type='OptimWrapper'",
                  "enabled='auto'"]),
])
def test_refused_at_start_up_naming_the_key(cfg, error, words):
    with pytest.raises(error) as e:
        translate_strategy(cfg)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_a_translated_key_mmfsdp_refuses_names_both(tmp_path):
    cfg = runner_config('refused', str(tmp_path), batch_size=4)
    cfg.update(runner_type='mmfsdp.FSDPRunner', strategy=dict(
        type='FSDPStrategy', model_wrapper=dict(limit_all_gathers=True)))
    with pytest.raises(TypeError) as e:
        FSDPRunner.from_cfg(Config(cfg))
    assert "'limit_all_gathers' is an FSDP1 option" in str(e.value)
    assert 'strategy.model_wrapper.limit_all_gathers → model_wrapper_cfg.limit_all_gathers' in \
        ''.join(e.value.__notes__)


def test_one_process_runner_builds_the_translated_optim_wrapper(tmp_path):
    cfg = runner_config('ds-one', str(tmp_path), batch_size=4, launcher='none', max_iters=2)
    cfg.update(runner_type='mmfsdp.FSDPRunner', log_level='INFO', strategy=MMPRETRAIN_DS,
               optim_wrapper=dict(type='DeepSpeedOptimWrapper', optimizer=dict(type='SGD', lr=0.1),
                                  constructor='DecayByDepth',
                                  paramwise_cfg=dict(layer_decay_rate=0.5)))
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    assert type(runner.optim_wrapper) is AmpOptimWrapper
    assert runner.optim_wrapper.loss_scaler.get_scale() == 2.0**15
    lrs = sorted({g['lr'] for g in runner.optim_wrapper.optimizer.param_groups})
    assert lrs == pytest.approx([0.1 * 0.5**3, 0.1 * 0.5**2, 0.1 * 0.5, 0.1])
    log = next(tmp_path.glob('*/*.log')).read_text()
    assert log.count("runs as mmfsdp's keys") == 1
    assert 'strategy.zero_optimization.overlap_comm=True → nothing to set' in log


# XTuner 0.2.0's shipped DeepSpeed JSONs (xtuner/configs/deepspeed/), their contents as data.
XTUNER_ZERO2 = {
    'gradient_accumulation_steps': 'auto', 'train_micro_batch_size_per_gpu': 'auto',
    'gradient_clipping': 'auto', 'zero_allow_untested_optimizer': True,
    'zero_force_ds_cpu_optimizer': False,
    'zero_optimization': {'stage': 2, 'overlap_comm': True},
    'fp16': {'enabled': 'auto', 'initial_scale_power': 16}, 'bf16': {'enabled': 'auto'}}
XTUNER_ZERO3_OFFLOAD = {
    'gradient_accumulation_steps': 'auto', 'train_micro_batch_size_per_gpu': 'auto',
    'gradient_clipping': 'auto', 'zero_allow_untested_optimizer': True,
    'zero_force_ds_cpu_optimizer': False,
    'zero_optimization': {
        'stage': 3, 'contiguous_gradients': False, 'allgather_bucket_size': 3e8,
        'reduce_bucket_size': 3e8, 'overlap_comm': True, 'reduce_scatter': True,
        'offload_optimizer': {'device': 'cpu', 'pin_memory': True},
        'offload_param': {'device': 'cpu', 'pin_memory': True},
        'stage3_gather_16bit_weights_on_model_save': True},
    'low_cpu_mem_usage': False,
    'fp16': {'enabled': True, 'initial_scale_power': 16}}
# the optim_wrapper of XTuner's LoRA configs (e.g. internlm2_chat_7b_qlora_alpaca_e3.py)
XTUNER_OPTIM = dict(type='AmpOptimWrapper', optimizer=dict(type='AdamW', lr=2e-4, betas=(
    0.9, 0.999), weight_decay=0), clip_grad=dict(max_norm=1, error_if_nonfinite=False),
    accumulative_counts=16, loss_scale='dynamic', dtype='float16')


class DeepSpeedStrategy(MMEngineDeepSpeedStrategy):
    """Stands for XTuner's ``xtuner.engine.DeepSpeedStrategy``, a subclass of mmengine's."""


DeepSpeedStrategy.__module__ = 'xtuner.engine._strategy.deepspeed'


def _xtuner_deepspeed(config, batch_size=1, **cfg):
    """The config as ``xtuner train CONFIG --deepspeed NAME`` leaves it (its tools/train.py):
    accumulation, micro batch and clipping written from the config, ``'auto'`` dtypes
    resolved (on a bf16 GPU for ZeRO-2), the optim wrapper replaced."""
    return dict(cfg, train_dataloader=dict(batch_size=batch_size), strategy=dict(
        type=DeepSpeedStrategy, config=config, gradient_accumulation_steps=16,
        train_micro_batch_size_per_gpu=batch_size, gradient_clipping=1,
        exclude_frozen_parameters=True, sequence_parallel_size=1),
        optim_wrapper=dict(type='DeepSpeedOptimWrapper', optimizer=XTUNER_OPTIM['optimizer']))


def test_xtuner_deepspeed_zero2_as_its_train_cli_builds_it():
    config = dict(XTUNER_ZERO2, fp16=dict(enabled=False, initial_scale_power=16),
                  bf16=dict(enabled=True))
    cfg = _xtuner_deepspeed(config)
    out = _translate(**cfg)
    assert out.model_wrapper_cfg == dict(type='mmfsdp.MMFullyShard',
                                         reshard_after_forward=False, auto_wrap_policy='auto')
    # the strategy's own keywords replace the JSON's 'auto', as mmengine merges them
    assert out.optim_wrapper_cfg(cfg['optim_wrapper']) == dict(
        type=AmpOptimWrapper, optimizer=XTUNER_OPTIM['optimizer'], dtype='bfloat16',
        loss_scale=dict(enabled=False), clip_grad=dict(max_norm=1), accumulative_counts=16)
    assert out.lines[0] == 'strategy.type=xtuner.engine._strategy.deepspeed.DeepSpeedStrategy ' \
        "→ read as mmengine's DeepSpeedStrategy (its keys keep their meaning)"
    assert 'strategy.gradient_accumulation_steps, strategy.train_micro_batch_size_per_gpu, ' \
        "strategy.gradient_clipping replace the config's" in out.lines[1]
    assert 'strategy.sequence_parallel_size=1 → nothing to set (no sequence parallelism' in \
        out.log_block()
    for key in ('zero_allow_untested_optimizer', 'zero_force_ds_cpu_optimizer',
                'exclude_frozen_parameters', 'zero_optimization.overlap_comm'):
        assert f'strategy.{key}' in _sources(out.lines), key


def test_xtuner_deepspeed_zero3_offload_json_file(tmp_path):
    path = tmp_path / 'deepspeed_zero3_offload.json'
    path.write_text(json.dumps(XTUNER_ZERO3_OFFLOAD))
    cfg = _xtuner_deepspeed(str(path))
    out = _translate(**cfg)
    assert out.model_wrapper_cfg == dict(
        type='mmfsdp.MMFullyShard', reshard_after_forward=True, auto_wrap_policy='auto',
        offload=dict(cpu_offload=True, pin_memory=True))
    assert out.optim_wrapper['dtype'] == 'float16'
    assert out.optim_wrapper['loss_scale'] == dict(init_scale=2.0**16, growth_interval=1000)
    for key in ('zero_optimization.stage3_gather_16bit_weights_on_model_save',
                'low_cpu_mem_usage', 'zero_optimization.reduce_bucket_size'):
        assert f'strategy.{key}' in _sources(out.lines), key


def test_deepspeed_json_auto_takes_the_configs_own_optim_wrapper(tmp_path):
    # xtuner train CONFIG --cfg-options runner_type=mmfsdp.FSDPRunner
    #     strategy.type=DeepSpeedStrategy strategy.config=deepspeed_zero2.json
    path = tmp_path / 'deepspeed_zero2.json'
    path.write_text(json.dumps(XTUNER_ZERO2))
    cfg = Config(dict(optim_wrapper=XTUNER_OPTIM, train_dataloader=dict(batch_size=1)))
    cfg.merge_from_dict({'runner_type': 'mmfsdp.FSDPRunner', 'strategy.type': 'DeepSpeedStrategy',
                         'strategy.config': str(path)})
    out = translate_strategy(cfg)
    assert out.model_wrapper_cfg['reshard_after_forward'] is False
    assert out.optim_wrapper == {}  # the config's AmpOptimWrapper, clip_grad, accumulation
    block = out.log_block()
    for line in ("strategy.gradient_accumulation_steps='auto' → nothing to set (the config's "
                 'optim_wrapper.accumulative_counts=16 stands)',
                 "strategy.gradient_clipping='auto' → nothing to set (the config's optim_wrapper"
                 ".clip_grad={'max_norm': 1, 'error_if_nonfinite': False} stands)",
                 "strategy.fp16.enabled='auto' → nothing to set (the config's optim_wrapper.type"
                 "='AmpOptimWrapper', dtype='float16' stands)",
                 "strategy.train_micro_batch_size_per_gpu='auto' → nothing to set"):
        assert line in block, line
    assert {'strategy.bf16.enabled', 'strategy.fp16.initial_scale_power',
            'strategy.zero_allow_untested_optimizer'} <= set(_sources(out.lines))
    # ZeRO-3's JSON says fp16: a bf16 optim wrapper trains otherwise, refused naming both
    path.write_text(json.dumps(XTUNER_ZERO3_OFFLOAD))
    with pytest.raises(ValueError, match=r"strategy.fp16.enabled=True and optim_wrapper.type="
                       r"'AmpOptimWrapper', dtype='bfloat16' train in different precisions"):
        translate_strategy(dict(cfg, optim_wrapper=dict(XTUNER_OPTIM, dtype='bfloat16')))


@pytest.mark.parametrize('kind', [
    DeepSpeedStrategy, 'xtuner.engine.DeepSpeedStrategy', 'mmengine.DeepSpeedStrategy',
    MMEngineDeepSpeedStrategy, 'DeepSpeedStrategy'])
def test_xtuner_and_mmengine_strategy_types_are_mmengines(kind):
    out = _translate(dict(type=kind, zero_optimization=dict(stage=3)))
    assert out.model_wrapper_cfg['reshard_after_forward'] is True
    named = kind not in (MMEngineDeepSpeedStrategy, 'DeepSpeedStrategy')
    assert (_sources(out.lines)[0] == 'strategy.type') == named


def test_a_config_lazy_strategy_class_is_built_and_read():
    # XTuner's --deepspeed writes type=LazyObject('xtuner.engine', 'DeepSpeedStrategy'):
    # the config builds it when read; here mmengine's own module stands for XTuner's
    cfg = Config(dict(strategy=dict(type=LazyObject('mmengine._strategy', 'DeepSpeedStrategy'),
                                    config=dict(zero_optimization=dict(stage=3)))))
    assert translate_strategy(cfg).model_wrapper_cfg['reshard_after_forward'] is True


@pytest.mark.parametrize('strategy, optim, words', [
    (dict(sequence_parallel_size=2), None, ['strategy.sequence_parallel_size=2',
                                            'no sequence parallelism', 'write 1']),
    (dict(config=XTUNER_ZERO2), None, ["strategy.fp16.enabled='auto'",
                                       'DeepSpeedOptimWrapper names none']),
    (dict(config=dict(optimizer=dict(type='Adam', params=dict(lr=1e-3)))), None,
     ['strategy.optimizer=', 'write optim_wrapper.optimizer']),
    (dict(config=dict(scheduler=dict(type='WarmupLR'))), None,
     ['strategy.scheduler=', 'write param_scheduler']),
    (dict(config=dict(train_batch_size=64), train_micro_batch_size_per_gpu=2), None,
     ['strategy.train_batch_size=64', 'batch_size=2 x accumulation 1 x 1 rank(s)']),
    (dict(config=dict(train_batch_size=4)), dict(type='DeepSpeedOptimWrapper',
                                                 accumulative_counts=3), None),
    (dict(config=dict(zero_allow_untested_optimiser=True)), None,
     ["strategy.config: unknown key 'zero_allow_untested_optimiser'",
      "did you mean 'zero_allow_untested_optimizer'"]),
    (dict(config='deepspeed_zero2'), None, ["strategy.config='deepspeed_zero2': cannot read",
                                            'xtuner/configs/deepspeed/']),
    (dict(config=dict(gradient_clipping='always')), None, ["strategy.gradient_clipping='always'",
                                                           "'auto'"]),
])
def test_deepspeed_config_refusals_name_the_key(strategy, optim, words):
    cfg = dict(strategy=dict(strategy, type='DeepSpeedStrategy'),
               train_dataloader=dict(batch_size=2))
    if optim:
        cfg['optim_wrapper'] = optim
    if words is None:  # train_batch_size=4 with accumulative_counts=3: not 2 x 3 x 1
        words = ['strategy.train_batch_size=4', 'accumulation 3']
    with pytest.raises((ValueError, TypeError)) as e:
        translate_strategy(cfg)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_deepspeed_train_batch_size_equal_to_the_configs_is_logged(monkeypatch):
    # the world size as the launcher names it before the process group starts
    monkeypatch.setenv('WORLD_SIZE', '2')
    out = _translate(dict(type='DeepSpeedStrategy', config=dict(
        train_batch_size=12, gradient_accumulation_steps=3)), train_dataloader=dict(batch_size=2),
        launcher='pytorch')
    assert out.optim_wrapper['accumulative_counts'] == 3
    assert 'strategy.train_batch_size=12 → nothing to set (train_dataloader.batch_size=2 x ' \
        'accumulation 3 x 2 rank(s))' in out.lines


def test_xtuner_cfg_options_line_builds_fsdprunner_with_the_configs_optim_wrapper(tmp_path):
    # what XTuner's tools/train.py does without --deepspeed: Config.fromfile, merge
    # --cfg-options, RUNNERS.build(cfg) by runner_type
    path = tmp_path / 'deepspeed_zero2.json'
    path.write_text(json.dumps(XTUNER_ZERO2))
    cfg = Config(runner_config('xtuner', str(tmp_path), batch_size=4, launcher='none',
                               max_iters=2, optim_wrapper=dict(
                                   type='AmpOptimWrapper', dtype='float16', loss_scale='dynamic',
                                   optimizer=dict(type='SGD', lr=0.1), accumulative_counts=2,
                                   clip_grad=dict(max_norm=1.0))))
    cfg.merge_from_dict({'runner_type': 'mmfsdp.FSDPRunner', 'strategy.type': 'DeepSpeedStrategy',
                         'strategy.config': str(path), 'log_level': 'INFO'})
    runner = RUNNERS.build(cfg)
    runner.train()
    assert type(runner) is FSDPRunner and type(runner.optim_wrapper) is AmpOptimWrapper
    assert runner.optim_wrapper._accumulative_counts == 2
    assert runner.optim_wrapper.clip_grad_kwargs == dict(max_norm=1.0)
    log = next(tmp_path.glob('*/*.log')).read_text()
    assert "strategy.gradient_accumulation_steps='auto' → nothing to set" in log
