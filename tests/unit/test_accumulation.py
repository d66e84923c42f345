"""Gradient accumulation, ``accumulation='sharded' | 'unsharded' | 'hybrid'``, FSDP1 and FSDP2.

Every run trains 2 ranks x 2 micro-steps of 4 samples per optimizer step in one
2-process gloo group and is compared with mmengine's stock ``Runner`` training
the accumulated batch (16 samples) in one step in this process; hybrid sharding
runs on a 2 x 2 mesh of 4 processes. The collectives of every micro-step are
counted (``benchmarks.comm``, which wraps the process group's methods and calls
through): they show which mode ran.
"""

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook

from harness import run_distributed
from toy import runner_config

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


# ---- hybrid sharding: 2 replicas x 2 shards ----------------------------------------------


def test_fsdp1_refuses_hybrid_accumulation_naming_fsdp2():
    from mmfsdp.wrappers.fsdp import FSDPConfig
    with pytest.raises(ValueError, match=r"accumulation='hybrid'.*FSDP1.*MMFullyShard"):
        FSDPConfig.from_dict(dict(sharding_strategy='HYBRID_SHARD', accumulation='hybrid'))


@pytest.mark.parametrize('kind', ['fsdp1', 'fsdp2'])
def test_accumulation_option_is_resolved_and_defaults_to_sharded(kind):
    from mmfsdp.options import Accumulation
    from mmfsdp.wrappers.fsdp import FSDPConfig
    from mmfsdp.wrappers.fsdp2 import FullyShardConfig
    config = FSDPConfig if kind == 'fsdp1' else FullyShardConfig
    assert config.from_dict({}).accumulation is Accumulation.SHARDED
    assert config.from_dict(dict(accumulation='Unsharded')).accumulation is Accumulation.UNSHARDED
    with pytest.raises(ValueError, match=r"model_wrapper_cfg\.accumulation: 'shard' is not "
                                         r"valid \(did you mean 'sharded'\?\)"):
        config.from_dict(dict(accumulation='shard'))
    with pytest.raises(TypeError, match=r'model_wrapper_cfg\.accumulation: expected'):
        config.from_dict(dict(accumulation=True))


@pytest.mark.parametrize('kind', [FSDP1, FSDP2])
def test_plan_gradient_bytes_follow_the_mode_when_accumulating(kind):
    from mmfsdp.plan import plan_for
    from mmfsdp.registry import MODEL_WRAPPERS
    from toy import ToyClassifier
    model = ToyClassifier()
    wrapper_cls = MODEL_WRAPPERS.get(kind.split('.')[-1])

    def grad_bytes(mode: str, counts: int) -> int:
        plan = plan_for(wrapper_cls, _wrapper(kind, mode), model, 2, dict(type='AdamW'),
                        accumulative_counts=counts)
        return sum(u.grad_bytes for u in plan.units)

    full = sum(p.numel() for p in model.parameters()) * 4
    assert grad_bytes('unsharded', COUNTS) == full  # every rank holds whole gradients
    for mode, counts in (('sharded', COUNTS), ('sharded', 1), ('unsharded', 1)):
        assert grad_bytes(mode, counts) <= full / 2 + 64  # the shard (and its padding)
