"""Meta-device initialisation: no rank ever holds the full model, and no tensor holds garbage.

With ``init_device='meta'`` in the wrapper config, :class:`mmfsdp.FSDPRunner`
builds the model with its parameters and buffers on the meta device
(:func:`build_on_meta`, :mod:`.build`), wraps it at once, and the wrapper
allocates, initialises and verifies it (:func:`materialize`): FSDP2 after
sharding (each rank allocates its shards), FSDP1 on the CPU before wrapping
(FSDP1 then moves it to the device unit by unit).

- :mod:`.build`: registration on meta; constructor values recorded;
- :mod:`.materialize`: allocate, replay construction, ``init_weights``;
- :mod:`.pretrained`: ``init_cfg=Pretrained`` reading only each rank's slices;
- :mod:`.written`: the sentinel check and its error, the same on every rank.
"""
from typing import Optional

from torch import nn

from .build import RECORD_LIMIT_BYTES, build_on_meta, empty_weights, recorded
from .materialize import materialize, set_preprocessor_device
from .pretrained import (
    SHARD_SAFE_INIT_TYPES,
    allow_unsafe_pretrained,
    check_init_cfgs,
    load_pretrained,
)
from .written import (
    Unwritten,
    UnwrittenTensorsError,
    WriteTracker,
    agree_on_unwritten,
    defer_check,
    unwritten,
)

__all__ = ['RECORD_LIMIT_BYTES', 'SHARD_SAFE_INIT_TYPES', 'Unwritten', 'UnwrittenTensorsError',
           'WriteTracker', 'agree_on_unwritten', 'allow_unsafe_pretrained', 'build_on_meta',
           'check_init_cfgs', 'check_meta_model', 'defer_check', 'empty_weights',
           'load_pretrained', 'materialize',
           'recorded', 'set_preprocessor_device', 'unwritten']


def check_meta_model(module: nn.Module, init_device: Optional[str], when: str) -> bool:
    """Whether ``module`` has meta tensors, which only ``init_device='meta'`` materialises.

    Raises ``ValueError`` for a meta model without that option, and for
    ``init_cfg`` entries that cannot initialise shards (:func:`check_init_cfgs`).
    ``when`` says when the wrapper materialises (``'before sharding'``).
    """
    on_meta = any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    if on_meta and init_device != 'meta':
        raise ValueError('model_wrapper_cfg.init_device: the model is on the meta device; '
                         f"set init_device='meta' to materialise it {when}")
    if on_meta:
        check_init_cfgs(module)
    return on_meta
