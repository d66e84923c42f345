"""Checkpoints of sharded models: full files, sharded directories, safe loading.

- :mod:`.state`: gather / scatter model and optimizer state, full or sharded;
- :mod:`.sharded`: the sharded directory format (``torch.distributed.checkpoint``);
- :mod:`.safe_io`: ``weights_only`` reading, message-hub encoding, atomic writes;
- :mod:`.mixin`: the Runner methods that use them;
- :mod:`.hook`: a ``CheckpointHook`` that deletes old checkpoints only after saving.
"""
from .hook import CheckpointHook
from .mixin import CheckpointMixin
from .safe_io import UNSAFE_SWITCH, UnsafeCheckpointError, load_file
from .sharded import META_FILE, is_sharded_checkpoint
from .state import StateDictType

__all__ = ['CheckpointHook', 'CheckpointMixin', 'META_FILE', 'StateDictType', 'UNSAFE_SWITCH',
           'UnsafeCheckpointError', 'is_sharded_checkpoint', 'load_file']
