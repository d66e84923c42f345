"""The one place mmfsdp touches private mmengine or torch API.

Each use carries a one-line ``# why:`` and ``tests/unit/test_compat.py`` has a test per
internal (``tests/dist/test_compat.py`` for gloo's worker threads, which need a group).
The torch version range is checked first, on import (:mod:`.version`).
"""
from .version import (
    MIN_TORCH,
    NEWEST_TORCH,
    TESTED_MMENGINE,
    TESTED_TORCH,
    VERSION,
    check_installed_torch,
    check_torch_version,
    parse_version,
    tested_versions_text,
)

check_installed_torch()

from .mmengine_private import *  # noqa: E402,F401,F403
from .mmengine_private import __all__ as _mmengine_names  # noqa: E402
from .torch_private import *  # noqa: E402,F401,F403
from .torch_private import __all__ as _torch_names  # noqa: E402

__all__ = ['MIN_TORCH', 'NEWEST_TORCH', 'TESTED_MMENGINE', 'TESTED_TORCH', 'VERSION',
           'check_installed_torch', 'check_torch_version', 'parse_version', 'tested_versions_text',
           *_mmengine_names, *_torch_names]
