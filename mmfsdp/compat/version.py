"""mmfsdp's release, and the oldest torch it runs on, checked when the package is imported."""
import re
from typing import Tuple

__all__ = ['MIN_TORCH', 'VERSION', 'check_installed_torch', 'check_torch_version', 'parse_version']

#: mmfsdp's release (also in setup.py).
VERSION = '0.1.0'

#: The oldest torch release mmfsdp supports (also in requirements.txt and the README).
MIN_TORCH: Tuple[int, int] = (2, 8)


def parse_version(version: str) -> Tuple[int, int]:
    """``(major, minor)`` of a torch version string (``'2.11.0+cu130'`` -> ``(2, 11)``)."""
    match = re.match(r'\s*(\d+)\.(\d+)', version)
    if match is None:
        raise ValueError(f'cannot read a torch version from {version!r}')
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str) -> None:
    """Raise ``ImportError`` naming the version needed when ``version`` is older than supported."""
    if parse_version(version) < MIN_TORCH:
        needed = '.'.join(map(str, MIN_TORCH))
        raise ImportError(
            f'mmfsdp needs torch >= {needed}, found torch {version}: FSDP2 shards the root with '
            f'fully_shard(reshard_after_forward=None) (torch {needed}) and its checkpoints use '
            f"DCP's _fqn_modifiers hook (torch 2.7); install torch>={needed}")


def check_installed_torch() -> None:
    """:func:`check_torch_version` on the torch this process imports."""
    import torch
    check_torch_version(torch.__version__)
