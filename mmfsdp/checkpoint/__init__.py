"""Checkpoints of sharded models: full files, sharded directories, safe loading.

- :mod:`.state`: gather / scatter model and optimizer state, full or sharded;
- :mod:`.sharded`: the sharded directory format (``torch.distributed.checkpoint``);
- :mod:`.safe_io`: ``weights_only`` reading, atomic writes;
- :mod:`.encoding`: message hub, numpy values, scheduler states as plain values;
- :mod:`.sources`: any location mmengine's ``load_checkpoint`` reads (URLs, zoo prefixes);
- :mod:`.matching`: mmengine's ``load_from`` rule (skip and list keys that do not fit);
- :mod:`.publish`: ``published_keys`` for full files and sharded directories;
- :mod:`.mixin`: the Runner methods that use them;
- :mod:`.hook`: a ``CheckpointHook`` that deletes old checkpoints (and the old best) only
  after saving.
"""
from .hook import CheckpointHook
from .mixin import CheckpointMixin
from .safe_io import UNSAFE_SWITCH, UnsafeCheckpointError, load_file
from .sharded import META_FILE, is_sharded_checkpoint
from .state import StateDictType

__all__ = ['CheckpointHook', 'CheckpointMixin', 'META_FILE', 'StateDictType', 'UNSAFE_SWITCH',
           'UnsafeCheckpointError', 'is_sharded_checkpoint', 'load_file']
