"""``EMAHook`` for sharded models: each rank averages only its own shards.

mmengine's ``EMAHook`` deep-copies the whole model on every rank and indexes
its parameters by name: under FSDP1 the names differ (``KeyError``), under
FSDP2 the parameters are DTensors (mixed Tensor/DTensor error), and every rank
holds a full copy. This hook keeps the same options, the same maths and the
same checkpoint format, in two parts:

- :mod:`.averaging`: ``ema_hook.ema_model`` is the configured ``ema_type``,
  as with the stock hook; its ``module`` is a copy of the model on one process
  (and under DDP), and under sharding this rank's pieces of the average under
  the model's names, averaged by the ``ema_type``'s own ``update_parameters``;
- :mod:`.checkpoint`: the averaged model in full files (the stock hook's
  format) and sharded directories, saved, resumed and loaded.

``FSDPRunner`` uses this hook wherever a config asks for ``EMAHook``::

    custom_hooks = [dict(type='EMAHook', ema_type='ExponentialMovingAverage',
                         momentum=0.0002)]
"""
from typing import Any, Mapping, Optional, Sequence

from mmengine.hooks import EMAHook as MMEngineEMAHook

from .averaging import ema_bytes_per_rank, reshard
from .checkpoint import EMA_SHARDS_KEY, EMAHook, full_ema_entries

__all__ = ['EMA_SHARDS_KEY', 'EMAHook', 'configures_ema', 'ema_bytes_per_rank',
           'full_ema_entries', 'reshard']


def configures_ema(custom_hooks: Optional[Sequence[Any]]) -> bool:
    """Whether a config's ``custom_hooks`` include an ``EMAHook`` (stock or mmfsdp's)."""
    names = ('EMAHook', 'mmfsdp.EMAHook', 'mmengine.EMAHook', MMEngineEMAHook, EMAHook)
    return any((h.get('type') if isinstance(h, Mapping) else type(h)) in names
               for h in custom_hooks or ())
