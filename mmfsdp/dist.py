"""Device and process-group start-up that works on CPU-only machines too.

mmengine's ``init_dist`` calls ``torch.cuda.set_device`` unconditionally and
defaults to NCCL, so a CPU-only machine cannot start a distributed run. Here
the device and the backend come from the environment: the accelerator torch
reports (CUDA, XPU, ...) picked by ``LOCAL_RANK``, else the CPU; the backend is
torch's default for that device (NCCL on CUDA, gloo on CPU) unless the config
names one.
"""
import datetime
import os
import subprocess
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from .startup import check_backend

__all__ = ['current_device', 'default_backend', 'init_distributed']

LAUNCHERS = ('pytorch', 'slurm', 'mpi')


def current_device() -> torch.device:
    """The device this process trains on: its accelerator by ``LOCAL_RANK``, or the CPU."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device('cpu')
    count = torch.accelerator.device_count()
    return torch.device(accelerator.type, int(os.environ.get('LOCAL_RANK', 0)) % count)


def default_backend(device: torch.device) -> str:
    """Torch's default collective backend for ``device`` (``'gloo'`` for the CPU)."""
    return dist.Backend.default_device_backend_map.get(device.type, 'gloo')


def _export_launcher_env(launcher: str) -> None:
    """Translate the variables of ``slurm`` / ``mpi`` into torchrun's."""
    if launcher == 'slurm':
        env = os.environ
        env.setdefault('RANK', env['SLURM_PROCID'])
        env.setdefault('WORLD_SIZE', env['SLURM_NTASKS'])
        env.setdefault('LOCAL_RANK', env['SLURM_LOCALID'])
        env.setdefault('MASTER_PORT', '29500')
        if 'MASTER_ADDR' not in env:
            hosts = subprocess.check_output(
                ['scontrol', 'show', 'hostnames', env['SLURM_NODELIST']], text=True)
            env['MASTER_ADDR'] = hosts.split()[0]
    elif launcher == 'mpi':
        env = os.environ
        env.setdefault('RANK', env['OMPI_COMM_WORLD_RANK'])
        env.setdefault('WORLD_SIZE', env['OMPI_COMM_WORLD_SIZE'])
        env.setdefault('LOCAL_RANK', env['OMPI_COMM_WORLD_LOCAL_RANK'])
        env.setdefault('MASTER_ADDR', '127.0.0.1')
        env.setdefault('MASTER_PORT', '29500')


def init_distributed(launcher: str, dist_cfg: Optional[Mapping[str, Any]] = None) -> None:
    """Start the default process group for ``launcher``.

    Args:
        launcher: ``'pytorch'`` (torchrun's variables), ``'slurm'`` (srun's)
            or ``'mpi'`` (Open MPI's).
        dist_cfg: ``env_cfg.dist_cfg``: ``backend`` (default: the device's),
            ``timeout`` in seconds, and other ``init_process_group`` keywords.

    Example::

        env_cfg = dict(dist_cfg=dict(timeout=600))  # gloo on CPU, nccl on CUDA

    """
    if launcher not in LAUNCHERS:
        raise ValueError(f'launcher: {launcher!r} is not valid; choose one of {LAUNCHERS}')
    kwargs = dict(dist_cfg or {})
    kwargs.pop('init_backend', None)
    check_backend(kwargs.get('backend'))
    timeout = kwargs.pop('timeout', None)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f'env_cfg.dist_cfg.timeout: expected seconds, got {timeout!r}')
        kwargs['timeout'] = datetime.timedelta(seconds=timeout)
    _export_launcher_env(launcher)
    device = current_device()
    if device.type != 'cpu':
        torch.accelerator.set_device_index(device.index)
    kwargs['backend'] = kwargs.get('backend') or default_backend(device)
    rank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    store = _restart_safe_store(world_size, kwargs.get('timeout'))
    if store is not None:
        kwargs['store'] = store
    dist.init_process_group(rank=rank, world_size=world_size, **kwargs)


def _restart_safe_store(world_size: int,
                        timeout: Optional[datetime.timedelta]) -> Optional[dist.Store]:
    """A store namespaced by torchrun's restart count, when workers share the agent's.

    torchrun's workers connect to the agent's TCPStore, which outlives a
    restart; without a namespace per attempt, a restarted rank can read a
    peer's address from the previous attempt and fail to connect (seen with
    gloo: "connectFullMesh failed ... Connection refused").
    """
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size,
                          is_master=False,
                          timeout=timeout or datetime.timedelta(minutes=30))
    attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
    return dist.PrefixStore(f'mmfsdp/attempt_{attempt}', store)
