"""Start-up on real process groups; FSDP1 hybrid sharding; FSDP2 offload on CPU.

- a CUDA build without a visible GPU trains on the CPU;
- 4 ranks started the way ``srun`` starts them (only ``SLURM_*`` variables,
  ``env_cfg.dist_cfg.port``; mmfsdp exports ``LOCAL_WORLD_SIZE``): FSDP1
  ``HYBRID_SHARD`` as 2 nodes x 2 ranks, saving a sharded checkpoint; FSDP2's
  ``shard='node'`` mesh;
- 2 ranks: that checkpoint resumed under ``FULL_SHARD``; FSDP2 with CPU
  offload, fp16 AMP and gradient clipping, against the same run without offload.
"""
import os
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config

from harness import DIST_CFG, run_distributed
from toy import runner_config

CUDA0, CPU = torch.device('cuda', 0), torch.device('cpu')
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
HYBRID = dict(type='mmfsdp.MMFullyShardedDataParallel', sharding_strategy='HYBRID_SHARD',
              auto_wrap_policy=BLOCKS)
FULL_SHARD = dict(type='mmfsdp.MMFullyShardedDataParallel', auto_wrap_policy=BLOCKS)
AMP_CLIP = dict(type='mmfsdp.AmpOptimWrapper', dtype='float16',
                optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=0.05))
GLOBAL_BATCH, HALF, TOTAL = 8, 3, 6
OTHER_WORLD_TOL = 2e-5


def test_a_cuda_build_without_visible_gpu_trains_on_the_cpu():
    # On a CUDA build of torch this is the regression test (it divided by zero);
    # on a CPU build it checks the same contract.
    code = ('from mmfsdp.dist import current_device, select_backend; d = current_device(); '
            'print(d, select_backend(d, True))')
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='-1')
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['cpu', 'gloo']


def _final_state(runner) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    model, _ = gather_full_state(runner.model, None)
    return {k: v.detach().clone() for k, v in model.items()}


def _toy_run(root: str, name: str, wrapper: dict, world_size: int, **extra) -> object:
    from mmfsdp import FSDPRunner
    optim = extra.pop('optim_wrapper', None)
    cfg = runner_config(name, f'{root}/{name}', wrapper=wrapper, optim_wrapper=optim,
                        batch_size=GLOBAL_BATCH // world_size, max_iters=TOTAL,
                        launcher=extra.pop('launcher', 'pytorch'))
    cfg.update(extra)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    return runner


def _under_slurm(root: str) -> dict:
    """4 ranks as srun starts them on 2 nodes of 2 tasks; the runner starts the group."""
    import mmfsdp  # noqa: F401
    from mmfsdp import MMFullyShard
    from toy import ToyClassifier
    rank, port = int(os.environ['RANK']), os.environ['MASTER_PORT']
    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_PORT'):
        del os.environ[key]
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS='4', SLURM_LOCALID=str(rank % 2),
                      SLURM_NODEID=str(rank // 2), SLURM_TASKS_PER_NODE='2(x2)')
    runner = _toy_run(root, 'hybrid', HYBRID, 4, launcher='slurm',
                      env_cfg=dict(dist_cfg=dict(DIST_CFG, port=int(port))),
                      default_hooks=dict(checkpoint=dict(
                          type='CheckpointHook', interval=HALF, by_epoch=False,
                          state_dict_type='sharded'), logger=dict(type='LoggerHook')))
    out = dict(local_world_size=os.environ['LOCAL_WORLD_SIZE'], port=os.environ['MASTER_PORT'],
               shard_group=torch.distributed.get_world_size(runner.model.process_group),
               final=_final_state(runner))
    node_mesh = MMFullyShard.from_options(ToyClassifier(),
                                          mesh=dict(replicate=-1, shard='node')).mesh
    out['fsdp2_node_mesh'] = (tuple(node_mesh.shape), node_mesh.mesh_dim_names)
    return out


def _two_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401
    resumed = _toy_run(root, 'hybrid-at2', FULL_SHARD, 2, resume=True,
                       load_from=os.path.join(root, 'hybrid', f'iter_{HALF}.pth'))
    out = dict(resumed=_final_state(resumed))
    for name, offload in (('offload', dict(cpu_offload=True, pin_memory=False)),
                          ('in-memory', None)):
        wrapper = dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=BLOCKS, offload=offload)
        runner = _toy_run(root, f'fsdp2-amp-{name}', wrapper, 2, optim_wrapper=AMP_CLIP)
        hub = runner.message_hub
        out[name] = dict(final=_final_state(runner),
                         grad_norm=[float(v) for v in hub.get_scalar('train/grad_norm').data[0]],
                         loss=[float(v) for v in hub.get_scalar('train/loss').data[0]],
                         devices=sorted({p.device.type for p in runner.model.parameters()}),
                         offloaded=type(runner.model.module.blocks[0]._get_fsdp_state()
                                        ._fsdp_param_group.offload_policy).__name__)
    return out


@pytest.fixture(scope='module')
def groups(tmp_path_factory) -> tuple:
    root = str(tmp_path_factory.mktemp('dist'))
    four = run_distributed(_under_slurm, 4, root)
    two = run_distributed(_two_ranks, 2, root)
    return four, two


def test_slurm_start_exports_local_world_size_and_uses_dist_cfg_port(groups):
    four, _ = groups
    assert {r['local_world_size'] for r in four} == {'2'}
    assert len({r['port'] for r in four}) == 1


def test_fsdp1_hybrid_shard_shards_within_each_node(groups):
    four, _ = groups
    assert [r['shard_group'] for r in four] == [2, 2, 2, 2]


def test_fsdp2_node_mesh_under_slurm(groups):
    four, _ = groups
    assert {r['fsdp2_node_mesh'] for r in four} == {((2, 2), ('replicate', 'shard'))}


def test_hybrid_sharded_checkpoint_at_4_resumes_at_2(groups):
    four, two = groups
    expected, got = four[0]['final'], two[0]['resumed']
    assert sorted(got) == sorted(expected)
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    print(f'HYBRID_SHARD 2x2 -> FULL_SHARD at 2: max abs diff {diff:.2e}')
    assert diff <= OTHER_WORLD_TOL


def test_fsdp2_offload_trains_with_amp_and_clipping_on_cpu(groups):
    _, two = groups
    offload, in_memory = two[0]['offload'], two[0]['in-memory']
    assert offload['offloaded'] == 'CPUOffloadPolicy'
    assert len(offload['grad_norm']) == TOTAL
    assert offload['grad_norm'] == pytest.approx(in_memory['grad_norm'], rel=1e-5)
    assert offload['loss'] == pytest.approx(in_memory['loss'], rel=1e-5)
    assert min(n for n in offload['grad_norm'] if n == n and n != float('inf')) > 0.05
    diff = max((offload['final'][k] - in_memory['final'][k]).abs().max().item()
               for k in in_memory['final'])
    assert diff <= 1e-6
