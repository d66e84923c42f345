"""Gradient accumulation, ``accumulation='sharded' | 'unsharded' | 'hybrid'``, FSDP1 and FSDP2.

Every run trains 2 ranks x 2 micro-steps of 4 samples per optimizer step in one
2-process gloo group and is compared with mmengine's stock ``Runner`` training
the accumulated batch (16 samples) in one step in this process; hybrid sharding
runs on a 2 x 2 mesh of 4 processes. The collectives of every micro-step are
counted (``collectives.CollectiveCounter``, which wraps the process group's methods
and calls through): they show which mode ran.
"""
import copy

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.runner import Runner

from harness import max_abs_diff, run_distributed
from toy import runner_config

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

TOL = 2e-5
WORLD_SIZE = 2
PER_RANK_BATCH = 4
COUNTS = 2
MAX_ITERS = 8  # 4 optimizer steps; the sampler's epochs (48 samples) end on a step
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
FSDP1 = 'mmfsdp.MMFullyShardedDataParallel'
FSDP2 = 'mmfsdp.MMFullyShard'
CLIP = dict(optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=0.05))
# SGD, not AdamW, under bf16: Adam's first steps move every weight by about lr, in the
# sign of its gradient, so a gradient near zero whose bf16 rounding differs between a
# batch of 4 and one of 16 flips a whole step; SGD's update follows the rounding error.
AMP = dict(type='mmfsdp.AmpOptimWrapper', dtype='bfloat16', clip_grad=dict(max_norm=0.05),
           optimizer=dict(type='SGD', lr=1e-2))


def _wrapper(kind: str, mode: str, **extra) -> dict:
    return dict(type=kind, auto_wrap_policy=BLOCKS, accumulation=mode, **extra)


#: run -> (model_wrapper_cfg, optim_wrapper without accumulative_counts)
RUNS = {
    f'{name}/{mode}/{precision}': (_wrapper(kind, mode), optim)
    for name, kind in (('fsdp1', FSDP1), ('fsdp2', FSDP2))
    for mode in ('sharded', 'unsharded')
    for precision, optim in (('fp32', CLIP), ('amp', AMP))
}
# ZeRO-2 with unsharded accumulation: parameters stay gathered through the micro-steps
RUNS['fsdp2/unsharded/zero2'] = (_wrapper(FSDP2, 'unsharded', reshard_after_forward=False),
                                 CLIP)
RUNS['fsdp2/sharded/zero2'] = (_wrapper(FSDP2, 'sharded', reshard_after_forward=False), CLIP)
#: run -> the run it resumes from (at iteration 4, after two optimizer steps)
RESUMED = {'fsdp1/sharded/fp32': 'resumed/fsdp1', 'fsdp2/sharded/fp32': 'resumed/fsdp2'}


class _MicroStepProbe(Hook):
    """Per iteration: bytes reduce-scattered / all-gathered / all-reduced across replicas
    (a hybrid mesh's ``replicate`` groups), and parameters left gathered."""

    def __init__(self, counter) -> None:
        self.counter = counter
        self.records = []

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        self.counter.reset()

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        from torch.distributed.tensor import DTensor
        counted = self.counter.snapshot()
        ops = counted['by_op']
        mesh = getattr(runner.model, 'mesh', None)
        replicas = (mesh['replicate'].get_group().group_name
                    if mesh is not None and 'replicate' in (mesh.mesh_dim_names or ()) else None)
        self.records.append(dict(
            reduce_scatter=sum(v['payload_bytes'] for k, v in ops.items() if 'reduce_scatter' in k),
            all_gather=sum(v['payload_bytes'] for k, v in ops.items()
                           if 'allgather' in k or 'all_gather' in k),
            across_replicas=sum(v for (op, group), v in counted['by_group'].items()
                                if group == replicas and 'allreduce' in op),
            # FSDP2 registers plain (unsharded) tensors while a unit is gathered
            gathered=sum(not isinstance(p, DTensor) for p in runner.model.parameters())))


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone().float() for k, v in state.items()}


def _config(name: str, work_dir: str, wrapper: dict, optim: dict, **extra) -> Config:
    cfg = runner_config(name, work_dir, wrapper=wrapper, batch_size=PER_RANK_BATCH,
                        max_iters=MAX_ITERS, optim_wrapper=dict(optim, accumulative_counts=COUNTS))
    cfg.update(extra)
    return Config(cfg)


def _train_all(root: str, prefix: str) -> dict:
    import mmfsdp  # noqa: F401  (registers the 'mmfsdp.' names)
    from collectives import CollectiveCounter
    from mmfsdp import FSDPRunner
    out = {}
    with CollectiveCounter() as counter:
        for run, (wrapper, optim) in RUNS.items():
            if not run.startswith(prefix):
                continue
            name = run.replace('/', '-')
            cfg = _config(name, f'{root}/{name}', wrapper, optim)
            if run in RESUMED:
                cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=4,
                                                    by_epoch=False)
            runner = FSDPRunner.from_cfg(cfg)
            probe = _MicroStepProbe(counter)
            runner.register_hook(probe, priority='VERY_LOW')
            runner.train()
            out[run] = dict(state=_full_state(runner.model), micro_steps=probe.records)
            if run in RESUMED:
                cfg = _config(f'{name}-resumed', f'{root}/{name}-resumed', wrapper, optim,
                              load_from=f'{root}/{name}/iter_4.pth', resume=True)
                runner = FSDPRunner.from_cfg(cfg)
                runner.train()
                out[RESUMED[run]] = dict(state=_full_state(runner.model), iter=runner.iter)
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> dict:
    """Every run, in one process group per wrapper.

    Five or six runner trainings of the toy model per group, which overran the
    default 240 s deadline at a load average above 20 on the shared 2 cores.
    """
    root = str(tmp_path_factory.mktemp('accumulate'))
    out = {}
    for prefix in ('fsdp1/', 'fsdp2/'):
        out.update(run_distributed(_train_all, WORLD_SIZE, root, prefix, timeout=480)[0])
    return out


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """One process, stock Runner, one step of the accumulated batch; memoised per optimizer."""
    cache = {}
    root = tmp_path_factory.mktemp('ref')

    def run(optim: dict) -> dict:
        key = repr(optim)
        if key not in cache:
            cfg = runner_config(f'ref{len(cache)}', str(root / str(len(cache))), launcher='none',
                                batch_size=PER_RANK_BATCH * WORLD_SIZE * COUNTS,
                                max_iters=MAX_ITERS // COUNTS, optim_wrapper=copy.deepcopy(optim))
            runner = Runner.from_cfg(Config(cfg))
            runner.train()
            cache[key] = {k: v.detach().clone() for k, v in runner.model.state_dict().items()}
        return cache[key]

    return run


@pytest.mark.parametrize('run', list(RUNS))
def test_final_weights_equal_one_process_with_the_accumulated_batch(run, runs, reference):
    diff = max_abs_diff(runs[run]['state'], reference(RUNS[run][1]))
    print(f'{run}: max abs diff {diff:.2e}')
    assert diff <= TOL


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2'])
def test_sharded_reduce_scatters_every_micro_step_unsharded_once_per_step(runs, wrapper):
    sharded = [r['reduce_scatter'] for r in runs[f'{wrapper}/sharded/fp32']['micro_steps']]
    unsharded = [r['reduce_scatter'] for r in runs[f'{wrapper}/unsharded/fp32']['micro_steps']]
    print(f'{wrapper}: reduce-scattered bytes per micro-step: sharded {sharded}, '
          f'unsharded {unsharded}')
    assert len(sharded) == len(unsharded) == MAX_ITERS
    assert min(sharded) > 0 and len(set(sharded)) == 1
    assert unsharded[0::COUNTS] == [0] * (MAX_ITERS // COUNTS)  # micro-steps under no_sync
    assert unsharded[COUNTS - 1::COUNTS] == sharded[COUNTS - 1::COUNTS]
    assert sum(sharded) == COUNTS * sum(unsharded)


def test_fsdp2_unsharded_zero2_keeps_parameters_gathered_between_micro_steps(runs):
    kept = runs['fsdp2/unsharded/zero2']['micro_steps']
    resharded = runs['fsdp2/sharded/zero2']['micro_steps']
    print(f'all-gathered bytes per micro-step: kept {[r["all_gather"] for r in kept]}, '
          f'sharded {[r["all_gather"] for r in resharded]}')
    # after the first micro-step every parameter is still gathered; the last reshards
    assert [r['gathered'] > 0 for r in kept] == [True, False] * (MAX_ITERS // COUNTS)
    assert all(r['gathered'] == 0 for r in resharded)
    # so the last micro-step gathers nothing, where 'sharded' gathers every unit again
    assert [r['all_gather'] for r in kept[1::COUNTS]] == [0] * (MAX_ITERS // COUNTS)
    assert all(r['all_gather'] > 0 for r in resharded)
    assert kept[0]['all_gather'] == resharded[0]['all_gather']


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2'])
def test_resume_between_steps_continues_exactly(runs, wrapper):
    resumed, straight = runs[f'resumed/{wrapper}'], runs[f'{wrapper}/sharded/fp32']
    assert resumed['iter'] == MAX_ITERS
    assert max_abs_diff(resumed['state'], straight['state']) == 0


# ---- hybrid sharding: 2 replicas x 2 shards ----------------------------------------------

HYBRID_WORLD = 4
HYBRID_SAMPLES = 64  # 16 per micro-step: an epoch is 2 optimizer steps, for 4 ranks and for one
HYBRID_MODES = ('sharded', 'hybrid')


def _hybrid_config(name: str, work_dir: str, mode: str, **extra) -> Config:
    wrapper = _wrapper(FSDP2, mode, mesh=dict(replicate=2, shard=2))
    cfg = runner_config(name, work_dir, wrapper=wrapper, batch_size=PER_RANK_BATCH,
                        max_iters=MAX_ITERS, dataset_length=HYBRID_SAMPLES,
                        optim_wrapper=dict(CLIP, accumulative_counts=COUNTS))
    cfg.update(extra)
    return Config(cfg)


def _train_hybrid(root: str) -> dict:
    import mmfsdp  # noqa: F401
    from collectives import CollectiveCounter
    from mmfsdp import FSDPRunner
    out = {}
    with CollectiveCounter() as counter:
        for mode in HYBRID_MODES:
            cfg = _hybrid_config(f'hsdp-{mode}', f'{root}/{mode}', mode)
            cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=4, by_epoch=False)
            runner = FSDPRunner.from_cfg(cfg)
            probe = _MicroStepProbe(counter)
            runner.register_hook(probe, priority='VERY_LOW')
            runner.train()
            out[mode] = dict(state=_full_state(runner.model),
                             all_reduced=[r['across_replicas'] for r in probe.records])
        cfg = _hybrid_config('hsdp-resumed', f'{root}/resumed', 'hybrid',
                             load_from=f'{root}/hybrid/iter_4.pth', resume=True)
        runner = FSDPRunner.from_cfg(cfg)
        runner.train()
        out['resumed'] = dict(state=_full_state(runner.model), iter=runner.iter)
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def hybrid_runs(tmp_path_factory) -> dict:
    return run_distributed(_train_hybrid, HYBRID_WORLD, str(tmp_path_factory.mktemp('hsdp')),
                           timeout=480)[0]


@pytest.mark.parametrize('mode', HYBRID_MODES)
def test_hybrid_sharding_equals_one_process_with_the_accumulated_batch(hybrid_runs, mode,
                                                                       tmp_path):
    cfg = runner_config('ref-hsdp', str(tmp_path), launcher='none',
                        batch_size=PER_RANK_BATCH * HYBRID_WORLD * COUNTS,
                        max_iters=MAX_ITERS // COUNTS, dataset_length=HYBRID_SAMPLES,
                        optim_wrapper=copy.deepcopy(CLIP))
    runner = Runner.from_cfg(Config(cfg))
    runner.train()
    diff = max_abs_diff(hybrid_runs[mode]['state'], runner.model.state_dict())
    print(f'hybrid sharding, accumulation={mode!r}: max abs diff {diff:.2e}')
    assert diff <= TOL


def test_hybrid_accumulation_all_reduces_across_replicas_once_per_step(hybrid_runs):
    sharded = hybrid_runs['sharded']['all_reduced']
    hybrid = hybrid_runs['hybrid']['all_reduced']
    print(f'bytes all-reduced across replicas per micro-step: sharded {sharded}, '
          f'hybrid {hybrid}')
    assert len(sharded) == len(hybrid) == MAX_ITERS and min(sharded) > 0
    assert hybrid[0::COUNTS] == [0] * (MAX_ITERS // COUNTS)  # micro-steps before the last
    assert hybrid[COUNTS - 1::COUNTS] == sharded[COUNTS - 1::COUNTS]
    assert sum(sharded) == COUNTS * sum(hybrid)


def test_hybrid_accumulation_resumes_exactly(hybrid_runs):
    resumed = hybrid_runs['resumed']
    assert resumed['iter'] == MAX_ITERS
    assert max_abs_diff(resumed['state'], hybrid_runs['hybrid']['state']) == 0


# ---- an evaluation between the micro-steps of one optimizer step ---------------------------

BF16_ONLY = dict(param_dtype='bf16')  # no reduce_dtype: FSDP2 keeps the unsharded bf16 gradient
ODD_ITERS = 6
#: run -> model_wrapper_cfg; each trains 6 iterations of 2 micro-steps per optimizer step
#: validated after iterations 3 and 6 ('odd'), 2, 4 and 6 ('even') or never ('none')
EVALUATED = {
    'fsdp2/unsharded/bf16': _wrapper(FSDP2, 'unsharded', mixed_precision=BF16_ONLY),
    'fsdp2/sharded/bf16': _wrapper(FSDP2, 'sharded', mixed_precision=BF16_ONLY),
    'fsdp1/unsharded/bf16': _wrapper(FSDP1, 'unsharded', mixed_precision=BF16_ONLY),
}
VAL_INTERVALS = dict(odd=3, even=2, none=ODD_ITERS + 1)


def _train_with_evaluations(root: str) -> dict:
    """Final weights and optimizer state of every run in :data:`EVALUATED`, per val interval."""
    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    out = {}
    for run, wrapper in EVALUATED.items():
        for when, interval in VAL_INTERVALS.items():
            if when == 'even' and run != 'fsdp2/unsharded/bf16':
                continue  # the scenario only: 'odd' against 'none' for the others
            name = f"{run.replace('/', '-')}-{when}"
            cfg = runner_config(name, f'{root}/{name}', wrapper=wrapper, val=True,
                                batch_size=PER_RANK_BATCH, max_iters=ODD_ITERS,
                                optim_wrapper=dict(CLIP, accumulative_counts=COUNTS))
            cfg['train_cfg']['val_interval'] = interval
            runner = FSDPRunner.from_cfg(Config(cfg))
            runner.train()
            model, optimizer = gather_full_state(runner.model, runner.optim_wrapper)
            out[run, when] = dict(model={k: v.detach().clone() for k, v in model.items()},
                                  optimizer=optimizer)
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def evaluated_runs(tmp_path_factory) -> dict:
    return run_distributed(_train_with_evaluations, WORLD_SIZE,
                           str(tmp_path_factory.mktemp('evaluated')), timeout=480)[0]


@pytest.mark.parametrize('run', list(EVALUATED))
def test_an_evaluation_between_micro_steps_leaves_training_bit_equal(evaluated_runs, run):
    """Validation after an odd iteration (inside the accumulation of 2 micro-steps) trains as
    no validation and as validation at step boundaries: weights and optimizer state equal.

    Before: with bf16 parameters and no reduce_dtype, FSDP2's switch to full precision
    for the evaluation dropped the unsharded gradient of the first micro-step (the
    unsharded parameter holding it was discarded): weights 2.8e-2 from no validation,
    optimizer state 2.4e-4; validated at step boundaries it was equal.
    """
    odd, none = evaluated_runs[run, 'odd'], evaluated_runs[run, 'none']
    diffs = dict(model=max_abs_diff(odd['model'], none['model']),
                 optimizer=max_abs_diff(odd['optimizer'], none['optimizer']))
    if (run, 'even') in evaluated_runs:
        even = evaluated_runs[run, 'even']
        diffs.update(even_model=max_abs_diff(even['model'], none['model']),
                     even_optimizer=max_abs_diff(even['optimizer'], none['optimizer']))
    print(f'{run}: validated after odd iterations vs never: {diffs}')
    assert diffs == dict.fromkeys(diffs, 0.0)


def _hybrid_with_evaluations(root: str) -> dict:
    """Hybrid accumulation in bf16, validated after iterations 3 and 6 or never: final state."""
    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    out = {}
    for when in ('odd', 'none'):
        cfg = _hybrid_config(f'hsdp-val-{when}', f'{root}/{when}', 'hybrid')
        cfg.model_wrapper_cfg.mixed_precision = BF16_ONLY
        val = runner_config('v', root, batch_size=PER_RANK_BATCH, val=True)
        cfg.merge_from_dict({k: val[k] for k in ('val_dataloader', 'val_cfg', 'val_evaluator')})
        cfg.train_cfg.update(max_iters=ODD_ITERS, val_interval=VAL_INTERVALS[when])
        runner = FSDPRunner.from_cfg(cfg)
        runner.train()
        out[when] = gather_full_state(runner.model, runner.optim_wrapper)
    return out if torch.distributed.get_rank() == 0 else None


def test_an_evaluation_between_hybrid_micro_steps_leaves_training_bit_equal(tmp_path):
    """As above, for accumulation='hybrid' (2 replicas x 2 shards, bf16, no reduce_dtype).

    A guard: it held before too, since hybrid accumulation keeps sharded gradients,
    which the evaluation's switch to full precision never touched.
    """
    runs = run_distributed(_hybrid_with_evaluations, HYBRID_WORLD, str(tmp_path), timeout=480)[0]
    (model, optimizer), (ref_model, ref_optimizer) = runs['odd'], runs['none']
    assert max_abs_diff(model, ref_model) == 0.0
    assert max_abs_diff(optimizer, ref_optimizer) == 0.0
