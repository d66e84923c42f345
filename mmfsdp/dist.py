"""Starting and leaving a distributed process, on CPU-only machines too.

mmengine's ``init_dist`` calls ``torch.cuda.set_device`` and defaults to NCCL,
so a CPU-only machine cannot start. Here the device is the usable accelerator
picked by ``LOCAL_RANK``, else the CPU, and the backend torch's default for it
(plus gloo for offloaded CPU tensors) unless ``env_cfg.dist_cfg`` names one.
Launch mistakes are refused on every rank before the group starts.

Leaving: :func:`shutdown_distributed` publishes background checkpoint writes
still in flight, destroys every group and waits until
gloo's worker threads are idle, so a finished job does not abort in the
interpreter's finalization (pytorch/pytorch#190489; ``docs/internals.md``).
"""
import atexit
import datetime
import os
import re
import subprocess
import time
import warnings
from typing import Any, Callable, Dict, List, Mapping, MutableMapping, Optional, Tuple

import torch
import torch.distributed as dist

from .compat import gloo_worker_threads

__all__ = [
    'before_shutdown', 'check_backend', 'check_launcher', 'current_device', 'default_backend',
    'export_launcher_env', 'init_distributed', 'local_world_size', 'registered_at_exit',
    'select_backend', 'select_device', 'set_current_device', 'settle_at_exit',
    'settle_gloo_workers', 'shutdown_at_exit', 'shutdown_distributed', 'teardown_at_exit'
]

LAUNCHERS = ('pytorch', 'slurm', 'mpi')

#: Variables that say "this process is one of N", and the launcher to name for each.
_WORLD_SIZE_VARIABLES = (('WORLD_SIZE', 'pytorch'), ('OMPI_COMM_WORLD_SIZE', 'mpi'))


def check_launcher(launcher: str) -> None:
    """Raise ``ValueError`` if ``launcher='none'`` in a process a launcher started as one of N."""
    if launcher != 'none':
        return
    for variable, fix in _WORLD_SIZE_VARIABLES:
        size = os.environ.get(variable, '')
        if size.isdigit() and int(size) > 1:
            raise ValueError(
                f"launcher: 'none', but {variable}={size} says a launcher started this process "
                f'as one of {size}: without a process group each would train alone, all into '
                f'the same work_dir. Pass --launcher {fix} to tools/train.py / tools/test.py '
                f"(config: launcher='{fix}')")


def check_backend(backend: Any) -> None:
    """Raise ``ValueError`` if ``env_cfg.dist_cfg.backend`` asks for NCCL without CUDA."""
    if backend is None or 'nccl' not in str(backend).lower() or torch.cuda.is_available():
        return
    raise ValueError(
        f'env_cfg.dist_cfg.backend: {backend!r} needs CUDA GPUs and this machine has none; '
        'remove the key (mmfsdp then picks gloo on the CPU and nccl on GPUs) or set it to '
        "'gloo', e.g. --cfg-options env_cfg.dist_cfg.backend=gloo")


def select_device(accelerator: Optional[str], device_count: int, local_rank: int) -> torch.device:
    """Accelerator ``local_rank % device_count`` of a usable ``accelerator`` type, or the CPU."""
    if accelerator is None or accelerator == 'cpu' or device_count < 1:
        return torch.device('cpu')
    return torch.device(accelerator, local_rank % device_count)


def current_device() -> torch.device:
    """The device this process trains on: its accelerator by ``LOCAL_RANK``, or the CPU."""
    # check_available: without it torch reports the accelerator it was built
    # for, also when none is visible (CUDA_VISIBLE_DEVICES=-1, CPU-only nodes).
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return select_device(accelerator.type if accelerator is not None else None,
                         torch.accelerator.device_count() if accelerator is not None else 0,
                         int(os.environ.get('LOCAL_RANK', 0)))


def set_current_device() -> torch.device:
    """Make this process's accelerator current (else NCCL barriers run on device 0)."""
    device = current_device()
    if device.type != 'cpu':
        torch.accelerator.set_device_index(device.index)
    return device


def default_backend(device: torch.device) -> str:
    """Torch's default collective backend for ``device`` (``'gloo'`` for the CPU)."""
    return dist.Backend.default_device_backend_map.get(device.type, 'gloo')


def select_backend(device: torch.device, offload: bool, configured: Optional[str] = None) -> str:
    """``configured`` if given, else the device's backend (plus gloo when ``offload``)."""
    if configured:
        return configured
    backend = default_backend(device)
    if offload and device.type != 'cpu' and backend != 'gloo':
        return f'cpu:gloo,{device.type}:{backend}'
    return backend


def local_world_size() -> Optional[int]:
    """``LOCAL_WORLD_SIZE``, the processes on this node (``None`` when unset)."""
    value = os.environ.get('LOCAL_WORLD_SIZE')
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f'LOCAL_WORLD_SIZE: expected a positive integer, got {value!r}')
    return int(value)


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Node ``node_id``'s task count in ``SLURM_TASKS_PER_NODE`` (``'4(x2),3'``: 4, 4, 3)."""
    counts = []
    for part in tasks_per_node.split(','):
        match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
        if match is None:
            raise ValueError(f'SLURM_TASKS_PER_NODE: cannot read {tasks_per_node!r}')
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_id]


def export_launcher_env(launcher: str, env: MutableMapping[str, str]) -> None:
    """Set torchrun's variables in ``env`` from Slurm's / Open MPI's, where unset."""
    if launcher == 'slurm':
        env.setdefault('RANK', env['SLURM_PROCID'])
        env.setdefault('WORLD_SIZE', env['SLURM_NTASKS'])
        env.setdefault('LOCAL_RANK', env['SLURM_LOCALID'])
        # srun always sets SLURM_TASKS_PER_NODE; wrappers around it may not,
        # and only mesh='node' needs the count (it says so when it is missing).
        if 'LOCAL_WORLD_SIZE' not in env and 'SLURM_TASKS_PER_NODE' in env:
            env['LOCAL_WORLD_SIZE'] = str(_slurm_tasks_on_node(
                env['SLURM_TASKS_PER_NODE'], int(env.get('SLURM_NODEID', 0))))
        env.setdefault('MASTER_PORT', '29500')
        if 'MASTER_ADDR' not in env:
            hosts = subprocess.check_output(
                ['scontrol', 'show', 'hostnames', env['SLURM_NODELIST']], text=True)
            env['MASTER_ADDR'] = hosts.split()[0]
    elif launcher == 'mpi':
        env.setdefault('RANK', env['OMPI_COMM_WORLD_RANK'])
        env.setdefault('WORLD_SIZE', env['OMPI_COMM_WORLD_SIZE'])
        env.setdefault('LOCAL_RANK', env['OMPI_COMM_WORLD_LOCAL_RANK'])
        env.setdefault('LOCAL_WORLD_SIZE', env['OMPI_COMM_WORLD_LOCAL_SIZE'])
        env.setdefault('MASTER_ADDR', '127.0.0.1')
        env.setdefault('MASTER_PORT', '29500')


def init_distributed(launcher: str, dist_cfg: Optional[Mapping[str, Any]] = None,
                     offload: bool = False) -> None:
    """Start the default process group for ``launcher``.

    Args:
        launcher: ``'pytorch'`` (torchrun's variables), ``'slurm'`` (srun's)
            or ``'mpi'`` (Open MPI's).
        dist_cfg: ``env_cfg.dist_cfg``: ``backend`` (default: see
            :func:`select_backend`), ``timeout`` in seconds, ``port`` (the
            master port under slurm / mpi, as in mmengine), and other
            ``init_process_group`` keywords.
        offload: Whether the model's parameters are offloaded to the CPU.

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
    port = kwargs.pop('port', None)
    if port is not None:
        if launcher == 'pytorch':
            warnings.warn('env_cfg.dist_cfg.port is ignored with --launcher pytorch: torchrun '
                          'sets the port (--master-port)', stacklevel=2)
        else:
            os.environ['MASTER_PORT'] = str(port)  # as mmengine: the config wins
    export_launcher_env(launcher, os.environ)
    device = set_current_device()
    kwargs['backend'] = select_backend(device, offload, kwargs.get('backend'))
    rank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    store = _restart_safe_store(world_size, kwargs.get('timeout'))
    if store is not None:
        kwargs['store'] = store
    dist.init_process_group(rank=rank, world_size=world_size, **kwargs)


def _restart_safe_store(world_size: int,
                        timeout: Optional[datetime.timedelta]) -> Optional[dist.Store]:
    """Torchrun's agent store, namespaced by restart count.

    A restarted rank must not read a peer's address from the previous attempt
    (gloo's "connectFullMesh failed").
    """
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world_size,
                          is_master=False,
                          timeout=timeout or datetime.timedelta(minutes=30))
    attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
    return dist.PrefixStore(f'mmfsdp/attempt_{attempt}', store)


# ---- leaving: groups destroyed, gloo workers idle, then exit ------------------------------
#: How long a worker must stay blocked, without running, to count as idle.
QUIET_S = 0.005


def _activity(tid: int) -> Optional[Tuple[str, int, int]]:
    """A thread's state and context-switch counts; ``None`` once it has ended."""
    try:
        with open(f'/proc/self/task/{tid}/status') as f:
            fields = dict(line.split(':', 1) for line in f if ':' in line)
    except OSError:
        return None
    return (fields['State'].split()[0], int(fields['voluntary_ctxt_switches']),
            int(fields['nonvoluntary_ctxt_switches']))


def settle_gloo_workers(timeout: float = 5.0) -> bool:
    """Wait until every gloo worker thread is idle; ``False`` if ``timeout`` passes first.

    Idle: sleeping, and not switched in once over :data:`QUIET_S` while this
    thread sleeps without the GIL (a worker with a release left would have run).
    """
    deadline = time.monotonic() + timeout
    before: Dict[int, Optional[Tuple[str, int, int]]] = {}
    while True:
        now = {tid: _activity(tid) for tid in gloo_worker_threads()}
        now = {tid: state for tid, state in now.items() if state is not None}
        if all(state[0] == 'S' and before.get(tid) == state for tid, state in now.items()):
            return True
        if time.monotonic() > deadline:
            return False
        before = now
        time.sleep(QUIET_S)


#: What :func:`shutdown_distributed` runs before it destroys the groups (:func:`before_shutdown`).
_BEFORE_SHUTDOWN: List[Callable[[], None]] = []


def before_shutdown(fn: Callable[[], None]) -> None:
    """Have :func:`shutdown_distributed` run ``fn()`` (once registered) while the groups exist.

    ``mmfsdp.checkpoint`` registers the publication of background writes still
    in flight: a write whose group is destroyed under it cannot finish.
    """
    if fn not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(fn)


def shutdown_distributed(timeout: float = 5.0) -> bool:
    """Finish what needs the groups, destroy every process group, then settle gloo; call it last.

    What needs the groups (:func:`before_shutdown`): a checkpoint still written
    in the background is waited for and published, collectively, so every
    rank calls this at the same point (as ``FSDPRunner`` does at exit).
    """
    if dist.is_initialized():
        for fn in _BEFORE_SHUTDOWN:
            fn()
        dist.destroy_process_group()
    return settle_gloo_workers(timeout)


_AT_EXIT: List[Callable[..., bool]] = []


def _once_at_exit(fn: Callable[..., bool]) -> None:
    if fn not in _AT_EXIT:  # one registration per process, however many runners are built
        _AT_EXIT.append(fn)
        atexit.register(fn)


def shutdown_at_exit() -> None:
    """Run :func:`shutdown_distributed` when the interpreter exits (before its finalization)."""
    _once_at_exit(shutdown_distributed)


def settle_at_exit() -> None:
    """Run :func:`settle_gloo_workers` when the interpreter exits, destroying no group."""
    _once_at_exit(settle_gloo_workers)


def registered_at_exit() -> List[str]:
    """The names of the teardown functions this process will run at exit, in registration order."""
    return [fn.__name__ for fn in _AT_EXIT]


def teardown_at_exit() -> None:
    """What a wrapper calls when built: settle gloo's workers at exit (once).

    Destroys no group: the stock Runner, or the caller, owns it.
    """
    if not _AT_EXIT:
        settle_at_exit()
