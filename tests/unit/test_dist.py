"""Device, backend and launcher start-up; FSDP1 hybrid sharding; FSDP2 offload on CPU.

Single-process checks of the pure selection functions (what a GPU node, a
CPU node and a CUDA build without a visible GPU each get), then two process
groups:

- 4 ranks started the way ``srun`` starts them (only ``SLURM_*`` variables,
  ``env_cfg.dist_cfg.port``; mmfsdp exports ``LOCAL_WORLD_SIZE``): FSDP1
  ``HYBRID_SHARD`` as 2 nodes x 2 ranks, saving a sharded checkpoint; FSDP2's
  ``shard='node'`` mesh;
- 2 ranks: that checkpoint resumed under ``FULL_SHARD``; FSDP2 with CPU
  offload, fp16 AMP and gradient clipping, against the same run without offload.
"""
import os

import pytest
import torch
from mmengine.config import Config

from harness import DIST_CFG, REPO, run_distributed
from mmfsdp.checkpoint.state import full_state_on_rank0
from mmfsdp.compat import MIN_TORCH, check_torch_version, parse_version
from mmfsdp.dist import export_launcher_env, local_world_size, select_backend, select_device
from toy import runner_config

CUDA0, CPU = torch.device('cuda', 0), torch.device('cpu')
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
HYBRID = dict(type='mmfsdp.MMFullyShardedDataParallel', sharding_strategy='HYBRID_SHARD',
              auto_wrap_policy=BLOCKS)
FULL_SHARD = dict(type='mmfsdp.MMFullyShardedDataParallel', auto_wrap_policy=BLOCKS)
AMP_CLIP = dict(type='mmfsdp.AmpOptimWrapper', dtype='float16',
                optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=0.05))
GLOBAL_BATCH, HALF, TOTAL = 8, 3, 6


@pytest.mark.parametrize('accelerator, count, local_rank, expected', [
    ('cuda', 8, 3, torch.device('cuda', 3)),
    ('cuda', 4, 6, torch.device('cuda', 2)),      # more ranks than GPUs on the node
    ('cuda', 0, 0, CPU),                          # CUDA build, no visible GPU
    (None, 0, 1, CPU),                            # CPU build
    ('xpu', 2, 1, torch.device('xpu', 1)),
])
def test_device_follows_the_usable_accelerator_and_local_rank(accelerator, count, local_rank,
                                                              expected):
    assert select_device(accelerator, count, local_rank) == expected


@pytest.mark.parametrize('device, offload, configured, expected', [
    (CUDA0, False, None, 'nccl'),
    (CUDA0, True, None, 'cpu:gloo,cuda:nccl'),    # offloaded gradients are CPU tensors
    (CPU, False, None, 'gloo'),
    (CPU, True, None, 'gloo'),
    (CUDA0, True, 'nccl', 'nccl'),                # dist_cfg.backend wins
    (CPU, False, 'gloo', 'gloo'),
])
def test_backend_from_device_offload_and_dist_cfg(device, offload, configured, expected):
    assert select_backend(device, offload, configured) == expected


def test_full_state_gathers_to_rank0_cpu_on_accelerators_only():
    assert full_state_on_rank0(CUDA0) and not full_state_on_rank0(CPU)


def _slurm_env(node: int, local: int, rank: int) -> dict:
    return dict(SLURM_PROCID=str(rank), SLURM_NTASKS='7', SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node), SLURM_TASKS_PER_NODE='3(x2),1', MASTER_ADDR='host0')


@pytest.mark.parametrize('node, expected', [(0, '3'), (1, '3'), (2, '1')])
def test_slurm_variables_give_local_world_size(node, expected):
    env = _slurm_env(node, 0, 3 * node)
    export_launcher_env('slurm', env)
    assert env['LOCAL_WORLD_SIZE'] == expected
    assert (env['RANK'], env['WORLD_SIZE'], env['LOCAL_RANK']) == (str(3 * node), '7', '0')


def test_slurm_without_tasks_per_node_leaves_local_world_size_unset():
    """A wrapper around srun that drops the count starts the job; only mesh='node' needs it."""
    env = _slurm_env(0, 0, 0)
    del env['SLURM_TASKS_PER_NODE']
    export_launcher_env('slurm', env)
    assert 'LOCAL_WORLD_SIZE' not in env
    assert (env['RANK'], env['WORLD_SIZE'], env['LOCAL_RANK']) == ('0', '7', '0')


def test_mpi_variables_give_local_world_size():
    env = dict(OMPI_COMM_WORLD_RANK='5', OMPI_COMM_WORLD_SIZE='8', OMPI_COMM_WORLD_LOCAL_RANK='1',
               OMPI_COMM_WORLD_LOCAL_SIZE='4')
    export_launcher_env('mpi', env)
    assert (env['RANK'], env['WORLD_SIZE'], env['LOCAL_RANK'], env['LOCAL_WORLD_SIZE']) == (
        '5', '8', '1', '4')


def test_torchrun_variables_are_kept():
    env = dict(_slurm_env(0, 0, 0), RANK='2', LOCAL_WORLD_SIZE='2')
    export_launcher_env('slurm', env)
    assert (env['RANK'], env['LOCAL_WORLD_SIZE']) == ('2', '2')


def test_local_world_size_is_read_in_one_place(monkeypatch):
    monkeypatch.delenv('LOCAL_WORLD_SIZE', raising=False)
    assert local_world_size() is None
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
    assert local_world_size() == 4
    monkeypatch.setenv('LOCAL_WORLD_SIZE', 'four')
    with pytest.raises(ValueError, match='LOCAL_WORLD_SIZE: expected a positive integer'):
        local_world_size()


@pytest.mark.parametrize('version', ['2.8.0', '2.11.0+cu130', '2.13.0', '2.14.0.dev20261101',
                                     '3.0.0'])
def test_supported_torch_versions_import(version):
    check_torch_version(version)


@pytest.mark.parametrize('version', ['2.6.0', '2.7.1+cpu', '1.13.1'])
def test_older_torch_is_refused_with_the_version_needed(version):
    with pytest.raises(ImportError, match=r'mmfsdp needs torch >= 2\.8, found torch'):
        check_torch_version(version)


def test_installed_torch_passes_the_guard_and_requirements_agree():
    assert parse_version(torch.__version__) >= MIN_TORCH
    with open(REPO / 'requirements.txt') as f:
        assert 'torch>=2.8' in f.read().split()


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
    node_mesh = MMFullyShard(ToyClassifier(), mesh=dict(replicate=-1, shard='node')).mesh
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


