"""FlexibleRunner strategies under FSDPRunner at 2 ranks: sharded, and equal to mmfsdp's own keys.

Each toy run with a ``strategy`` (mmpretrain's FSDP one with a size-based policy and no
``state_dict_cfg``; DeepSpeed ZeRO-3 fp16 and ZeRO-2 bf16 with ``DeepSpeedOptimWrapper`` and a
layer-wise lr decay constructor; ZeRO-2 with DeepSpeed's ``gradient_clipping=0.0``, no
clipping) is trained beside the same run written with mmfsdp's native keys, in one 2-process
group. The translation itself: ``tests/unit/test_strategies.py``.
"""
import os

from mmengine.config import Config

from harness import max_abs_diff, run_distributed
from toy import runner_config

# no state_dict_cfg: mmengine's default 'local', per-rank shards
FSDP = dict(type='FSDPStrategy', model_wrapper=dict(auto_wrap_policy=dict(
    type='torch.distributed.fsdp.wrap.size_based_auto_wrap_policy', min_num_params=1e3)))
ZERO = dict(allgather_partitions=True, reduce_scatter=True, allgather_bucket_size=50000000,
            reduce_bucket_size=50000000, overlap_comm=True, contiguous_gradients=True,
            cpu_offload=False)
FP16 = dict(enabled=True, fp16_master_weights_and_grads=False, loss_scale=0, loss_scale_window=500,
            hysteresis=2, min_loss_scale=1, initial_scale_power=15)
DS3 = dict(type='DeepSpeedStrategy', fp16=FP16, inputs_to_half=['inputs'],
           zero_optimization=dict(ZERO, stage=3))
DS2 = dict(type='DeepSpeedStrategy', bf16=dict(enabled=True), zero_optimization=dict(ZERO, stage=2))
# DeepSpeed's gradient_clipping=0.0 is its default, no clipping
DS2_NO_CLIP = dict(type='DeepSpeedStrategy', gradient_clipping=0.0, zero_optimization=dict(stage=2))
SGD = dict(optimizer=dict(type='SGD', lr=0.1))
DECAY = dict(optimizer=dict(type='AdamW', lr=1e-2), constructor='DecayByDepth',
             paramwise_cfg=dict(layer_decay_rate=0.5))
AMP = dict(DECAY, type='mmfsdp.AmpOptimWrapper')
#: name: (the FlexibleRunner config's keys, the same run in mmfsdp's own keys)
RUNS = dict(
    fsdp=(dict(strategy=FSDP, optim_wrapper=dict(type='AmpOptimWrapper', optimizer=dict(
              type='AdamW', lr=1e-2))),
          dict(model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=dict(
              type='size_based', min_num_params=1000)),
               optim_wrapper=dict(type='mmfsdp.AmpOptimWrapper', optimizer=dict(
                   type='AdamW', lr=1e-2)), checkpoint=dict(state_dict_type='sharded'))),
    zero3_fp16=(dict(strategy=DS3, optim_wrapper=dict(DECAY, type='DeepSpeedOptimWrapper')),
                dict(model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard',
                                            reshard_after_forward=True, auto_wrap_policy='auto'),
                     optim_wrapper=dict(AMP, dtype='float16', loss_scale=dict(
                         init_scale=2.0**15, growth_interval=500)))),
    zero2_bf16=(dict(strategy=DS2, optim_wrapper=dict(DECAY, type='DeepSpeedOptimWrapper')),
                dict(model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard',
                                            reshard_after_forward=False, auto_wrap_policy='auto'),
                     optim_wrapper=dict(AMP, dtype='bfloat16', loss_scale=dict(enabled=False)))),
    zero2_no_clipping=(dict(strategy=DS2_NO_CLIP, optim_wrapper=dict(SGD,
                                                                     type='DeepSpeedOptimWrapper')),
                       dict(model_wrapper_cfg=dict(type='mmfsdp.MMFullyShard',
                                                   reshard_after_forward=False,
                                                   auto_wrap_policy='auto'),
                            optim_wrapper=dict(SGD, type='OptimWrapper'))),
)


def _train(root: str, name: str, keys: dict) -> dict:
    from torch.distributed.tensor import DTensor

    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    keys = dict(keys)
    cfg = runner_config(name, f'{root}/{name}', batch_size=4, max_iters=4,
                        optim_wrapper=keys.pop('optim_wrapper'))
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=4, by_epoch=False,
                                              **keys.pop('checkpoint', {}))
    cfg.update(keys, runner_type='mmfsdp.FSDPRunner', log_level='INFO')
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    log = open(next(os.path.join(runner.log_dir, f) for f in os.listdir(runner.log_dir)
                    if f.endswith('.log'))).read()
    return dict(
        state=gather_full_state(runner.model, None)[0],
        wrapper=type(runner.model).__name__,
        sharded=all(isinstance(p, DTensor) for p in runner.model.parameters()),
        plan=log.split('Sharding plan:\n')[1].split(' ')[0],
        translated=log.count("runs as mmfsdp's keys"),
        optim=type(runner.optim_wrapper).__name__,
        lrs=sorted({round(g['lr'], 12) for g in runner.optim_wrapper.optimizer.param_groups}),
        checkpoint_is_dir=os.path.isdir(f'{root}/{name}/iter_4.pth'))


def _all_runs(root: str) -> dict:
    return {f'{name}/{kind}': _train(root, f'{name}-{kind}', keys)
            for name, pair in RUNS.items() for kind, keys in zip(('strategy', 'native'), pair)}


def test_strategies_train_sharded_and_equal_native_keys(tmp_path):
    out = run_distributed(_all_runs, 2, str(tmp_path), timeout=400)[0]
    for name in RUNS:
        got, native = out[f'{name}/strategy'], out[f'{name}/native']
        diff = max_abs_diff(got['state'], native['state'])
        print(f'{name}: {got["wrapper"]}, plan {got["plan"]}, optim {got["optim"]}, '
              f'lrs {got["lrs"]}, max abs diff to native keys {diff:.1e}')
        assert got['wrapper'] == 'MMFullyShard' and got['sharded']
        assert got['plan'] == 'mmfsdp.MMFullyShard'
        assert got['translated'] == 1 and native['translated'] == 0
        assert got['optim'] == native['optim'] == (
            'OptimWrapper' if name == 'zero2_no_clipping' else 'AmpOptimWrapper')
        assert got['lrs'] == native['lrs']
        assert got['checkpoint_is_dir'] == native['checkpoint_is_dir']
        assert diff == 0.0
    # the layer-wise decay constructor of DeepSpeedOptimWrapper is honoured
    assert out['zero3_fp16/strategy']['lrs'] == [1e-2 * 0.5**3, 1e-2 * 0.5**2, 1e-2 * 0.5, 1e-2]
    assert out['fsdp/strategy']['checkpoint_is_dir']  # no state_dict_cfg: 'local', sharded
