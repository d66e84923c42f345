"""The one place mmfsdp touches private mmengine or torch API.

Nothing else in the package names a private mmengine / torch attribute; it
uses the names defined here. Each use carries a one-line reason, and
``tests/test_compat.py`` has a test per internal that fails, naming it, when
an mmengine or torch release changes it. The torch version floor is checked
first, on import, before anything reaches the newer APIs.

- :mod:`.version`: the oldest torch mmfsdp runs on.
- :mod:`.mmengine_private`: ``Runner._init_model_weights``, ``_load_from``,
  ``_resume``, ``_has_loaded``; ``CheckpointHook``'s save steps and state;
  ``OptimWrapper``'s clipping; ``AmpOptimWrapper``'s CUDA-only ``__init__``;
  ``MODULE2PACKAGE``; ``PretrainedInit.__call__`` and the init-info log; the
  stock ``Runner.wrap_model`` found on the call stack.
- :mod:`.torch_private`: activation-checkpoint wrappers, FSDP1's ``_handle``,
  ``_reshard`` and ``_HYBRID_SHARD_ZERO2``, ``_reset_parameters``, DCP's
  ``_fqn_modifiers``, ``Module._apply`` and the registration dicts
  (``_modules``, ``_parameters``, ``_buffers``), ``TorchDispatchMode`` and
  operator schemas, storage identity on the meta device.
"""
from .version import (
    MIN_TORCH,
    VERSION,
    check_installed_torch,
    check_torch_version,
    parse_version,
)

check_installed_torch()

from .mmengine_private import *  # noqa: E402,F401,F403
from .mmengine_private import __all__ as _mmengine_names  # noqa: E402
from .torch_private import *  # noqa: E402,F401,F403
from .torch_private import __all__ as _torch_names  # noqa: E402

__all__ = ['MIN_TORCH', 'VERSION', 'check_installed_torch', 'check_torch_version', 'parse_version',
           *_mmengine_names, *_torch_names]
