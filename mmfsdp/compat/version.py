"""mmfsdp's release and the torch / mmengine releases it is tested on: the one place that says so.

``import mmfsdp`` refuses a torch older than the oldest tested and warns on one newer
than the newest tested. README.md and docs/get-started.md list :func:`tested_versions_text`
(``tests/unit/test_docs.py`` holds them to it); requirements.txt declares the same floor.
"""
import re
import warnings
from typing import Tuple

__all__ = ['MIN_TORCH', 'NEWEST_TORCH', 'TESTED_MMENGINE', 'TESTED_TORCH', 'VERSION',
           'check_installed_torch', 'check_torch_version', 'parse_version',
           'tested_versions_text']

#: mmfsdp's release (also in setup.py).
VERSION = '0.1.0'

#: The torch releases every tier is run on (tools/test_torch.sh VERSION TIER), oldest first;
#: CI runs the README's suite on the first and the unit tier and the dist smoke on the last.
TESTED_TORCH: Tuple[str, ...] = ('2.13.0', '2.14.1', '2.15.0')
#: The mmengine releases the suite is run on.
TESTED_MMENGINE: Tuple[str, ...] = ('0.10.7', )


def parse_version(version: str) -> Tuple[int, int]:
    """``(major, minor)`` of a torch version string (``'2.11.0+cu130'`` -> ``(2, 11)``)."""
    match = re.match(r'\s*(\d+)\.(\d+)', version)
    if match is None:
        raise ValueError(f'cannot read a torch version from {version!r}')
    return int(match.group(1)), int(match.group(2))


#: The oldest torch mmfsdp supports: the oldest it is tested on (also in requirements.txt).
MIN_TORCH: Tuple[int, int] = parse_version(TESTED_TORCH[0])
#: The newest torch release mmfsdp is tested on; a newer one imports with a warning.
NEWEST_TORCH: Tuple[int, int] = parse_version(TESTED_TORCH[-1])


def _text(version: Tuple[int, int]) -> str:
    return '.'.join(map(str, version))


def check_torch_version(version: str) -> None:
    """Refuse a torch older than the oldest tested; warn on one newer than the newest tested.

    The refusal (``ImportError``) names the version needed; the warning (``UserWarning``)
    says how to check the newer torch or which one to install.
    """
    found = parse_version(version)
    if found < MIN_TORCH:
        needed = _text(MIN_TORCH)
        raise ImportError(
            f'mmfsdp needs torch >= {needed}, found torch {version}: mmfsdp is tested on torch '
            f'{", ".join(TESTED_TORCH)} and reaches into FSDP2 internals that change between '
            f'releases (mmfsdp/compat); install torch>={needed}')
    if found > NEWEST_TORCH:
        warnings.warn(
            f'mmfsdp is tested on torch {", ".join(TESTED_TORCH)}; torch {version} is newer: '
            f'FSDP internals mmfsdp relies on may have changed. Run `tools/test_torch.sh '
            f'{version.split("+")[0]} smoke` to check it, or install torch=={TESTED_TORCH[-1]}',
            UserWarning, stacklevel=2)


def check_installed_torch() -> None:
    """:func:`check_torch_version` on the torch this process imports."""
    import torch
    check_torch_version(torch.__version__)


def tested_versions_text() -> str:
    """The torch and mmengine rows of the supported-versions table (README, get-started)."""
    return (f'| torch | ≥ {_text(MIN_TORCH)} (`import mmfsdp` refuses older ones with the version '
            f'needed, warns on one newer than {_text(NEWEST_TORCH)}); tested with '
            f'{", ".join(TESTED_TORCH)} |\n'
            f'| mmengine | 0.10.x (`mmengine>=0.10,<0.11`); tested with '
            f'{", ".join(TESTED_MMENGINE)} |')
