"""Launch mistakes that would otherwise fail late, cryptically, or not at all.

Each check runs on every rank before the process group starts, so a mistake
is one clear error everywhere instead of a hang or N silent jobs:

- ``torchrun`` (or ``mpirun``) started several processes but the config says
  ``launcher='none'``: each would train alone, all into one ``work_dir``;
- ``env_cfg.dist_cfg.backend='nccl'`` (as in OpenMMLab ``default_runtime.py``
  files) on a machine without CUDA, where torch's own error names no key.
"""
import os
from typing import Any

import torch

__all__ = ['check_backend', 'check_launcher']

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
