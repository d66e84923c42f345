"""Meta-device initialisation: no rank ever holds the full model, and no tensor holds garbage.

With ``init_device='meta'`` in the wrapper config, :class:`mmfsdp.FSDPRunner`
builds the model with its parameters and buffers on meta (:mod:`.build`), and the
wrapper allocates, initialises and verifies it (:mod:`.materialize`)::

    model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard', init_device='meta')

How it works, and what is guaranteed: docs/meta-init.md.
"""
from .build import RECORD_LIMIT_BYTES, build_on_meta, empty_weights, recorded
from .materialize import (
    SHARD_SAFE_INIT_TYPES,
    Unwritten,
    UnwrittenTensorsError,
    WriteTracker,
    agree_on_unwritten,
    check_init_cfgs,
    check_meta_model,
    defer_check,
    load_pretrained,
    materialize,
    set_preprocessor_device,
    unwritten,
)

__all__ = ['RECORD_LIMIT_BYTES', 'SHARD_SAFE_INIT_TYPES', 'Unwritten', 'UnwrittenTensorsError',
           'WriteTracker', 'agree_on_unwritten', 'build_on_meta', 'check_init_cfgs',
           'check_meta_model', 'defer_check', 'empty_weights', 'load_pretrained', 'materialize',
           'recorded', 'set_preprocessor_device', 'unwritten']
