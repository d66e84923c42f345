"""Checkpoints of sharded models: full files, sharded directories, safe loading.

- :mod:`.state`: model and optimizer state, full or sharded; the sharded directory format;
- :mod:`.safe_io`: ``weights_only`` reading from any location, and the values it accepts;
- :mod:`.durable`: crash-safe writes, clean-up of a run's own temporaries, completeness;
- :mod:`.hook`: a ``CheckpointHook`` that deletes old checkpoints only after saving;
- :mod:`.runner_methods`: the Runner methods that use them (imported by the runner; it swaps in
  :class:`mmfsdp.ema.EMAHook`, which itself reads and writes through :mod:`.state`).

Formats, guarantees and options: ``docs/checkpoints.md``.
"""
from .hook import CheckpointHook
from .safe_io import UNSAFE_SWITCH, UnsafeCheckpointError, load_file
from .state import META_FILE, StateDictType, is_sharded_checkpoint

__all__ = ['CheckpointHook', 'META_FILE', 'StateDictType', 'UNSAFE_SWITCH',
           'UnsafeCheckpointError', 'is_sharded_checkpoint', 'load_file']
