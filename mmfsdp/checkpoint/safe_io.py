"""Reading and writing checkpoint files safely.

Reading uses ``torch.load(weights_only=True)``, which refuses any pickled
global outside torch's allow-list before executing anything. mmfsdp's own
files need nothing more: the message hub is stored as tensors and plain Python
values (:func:`encode_message_hub`). An ordinary mmengine checkpoint pickles
mmengine and numpy classes; it loads only when the user opts in with the
config switch :data:`UNSAFE_SWITCH` (``allow_unsafe_checkpoints = True``), and
then with a warning naming the file.

Writing goes to a temporary name first, is flushed to the disk and renamed
into place (:mod:`.durable`), so a crash mid-write never leaves a truncated
file under the final name.
"""
import pickle
import warnings
from typing import Any, Dict, Mapping

import numpy as np
import torch
from mmengine.logging import HistoryBuffer, MessageHub

from .durable import replace_path, save_atomically

__all__ = ['UNSAFE_SWITCH', 'UnsafeCheckpointError', 'decode_message_hub', 'encode_message_hub',
           'load_file', 'replace_path', 'save_atomically']

#: The top-level config key that allows loading checkpoints that need arbitrary globals.
UNSAFE_SWITCH = 'allow_unsafe_checkpoints'

_BUFFER = '__history_buffer__'


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs globals that ``weights_only`` loading does not allow."""


def load_file(path: str, allow_unsafe: bool = False) -> Any:
    """``torch.load`` to the CPU with ``weights_only=True``, unless the user opted out."""
    try:
        # mmap: tensors are paged in as they are read, so taking one shard of a
        # large full checkpoint does not hold the whole file in memory first.
        return torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if not allow_unsafe:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise UnsafeCheckpointError(
                f'{path} needs globals that safe loading (weights_only=True) rejects: {reason} '
                'Nothing from the file was executed. If you trust this file, set '
                f'`{UNSAFE_SWITCH} = True` in the config to load it with weights_only=False.'
            ) from None
    warnings.warn(f'Loading {path} with weights_only=False ({UNSAFE_SWITCH}=True): '
                  'unpickling can execute arbitrary code', stacklevel=2)
    return torch.load(path, map_location='cpu', weights_only=False)


def _encode(value: Any) -> Any:
    if isinstance(value, HistoryBuffer):
        history, counts = value.data
        return {_BUFFER: True, 'log': torch.from_numpy(np.asarray(history, dtype=np.float64)),
                'count': torch.from_numpy(np.asarray(counts, dtype=np.float64)),
                'max_length': value.max_length}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v) for v in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, Mapping) and value.get(_BUFFER):
        return HistoryBuffer(value['log'].numpy(), value['count'].numpy(), value['max_length'])
    if isinstance(value, Mapping):
        return {k: _decode(v) for k, v in value.items()}
    return value


def encode_message_hub(message_hub: MessageHub) -> Dict[str, Any]:
    """``message_hub.state_dict()`` as tensors and plain values (``weights_only``-safe)."""
    return _encode(message_hub.state_dict())


def decode_message_hub(state: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`encode_message_hub`; mmengine's own format passes through."""
    return _decode(state)
