"""Start-up choices without a process group: device, backend, local world size, torch version.

What a GPU node, a CPU node and a CUDA build without a visible GPU each get; the
local world size from Slurm, Open MPI and torchrun variables; the torch guard.
"""

import warnings

import pytest
import torch

from harness import REPO
from mmfsdp.checkpoint.state import full_state_on_rank0
from mmfsdp.compat import MIN_TORCH, TESTED_TORCH, check_torch_version, parse_version
from mmfsdp.dist import export_launcher_env, local_world_size, select_backend, select_device

CUDA0, CPU = torch.device('cuda', 0), torch.device('cpu')
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


@pytest.mark.parametrize('version', ['2.13.0', '2.14.1+cu130', '2.15.0', '2.15.2',
                                     '2.14.0.dev20261101'])
def test_tested_torch_versions_import_quietly(version):
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        check_torch_version(version)


@pytest.mark.parametrize('version', ['2.12.1', '2.8.0', '2.7.1+cpu', '1.13.1'])
def test_older_torch_is_refused_with_the_version_needed(version):
    with pytest.raises(ImportError, match=r'mmfsdp needs torch >= 2\.13, found torch'):
        check_torch_version(version)


@pytest.mark.parametrize('version', ['2.16.0', '2.16.0.dev20261201+cu132', '3.0.0'])
def test_a_torch_newer_than_the_newest_tested_warns_and_says_how_to_check_it(version):
    with pytest.warns(UserWarning, match=r'tested on torch 2\.13\.0, 2\.14\.1, 2\.15\.0; torch '
                      r'.* is newer.*tools/test_torch\.sh .* smoke'):
        check_torch_version(version)


def test_installed_torch_passes_the_guard_and_requirements_agree():
    """The floor is the oldest tested torch, and requirements.txt (setup.py) declares it."""
    assert parse_version(torch.__version__) >= MIN_TORCH == parse_version(TESTED_TORCH[0])
    with open(REPO / 'requirements.txt') as f:
        assert f'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}' in f.read().split()
