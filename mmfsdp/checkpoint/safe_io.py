"""Reading and writing checkpoint files safely.

Reading uses ``torch.load(weights_only=True)``, which refuses any pickled
global outside torch's allow-list before executing anything. mmfsdp's own
files need nothing more: the message hub and numpy values are stored as
tensors and plain Python values (:mod:`.encoding`). An ordinary mmengine checkpoint pickles
mmengine and numpy classes, and files in torch's legacy (non-zip) format are
read only by the full unpickler; both load only when the user opts in with the
config switch :data:`UNSAFE_SWITCH` (``allow_unsafe_checkpoints = True``), and
then with a warning naming the file.

Writing goes to a temporary name first, is flushed to the disk and renamed
into place (:mod:`.durable`), so a crash mid-write never leaves a truncated
file under the final name.
"""
import pickle
import warnings
from typing import IO, Any, Union

import torch

from .durable import replace_path, save_atomically

__all__ = ['UNSAFE_SWITCH', 'UnsafeCheckpointError', 'load_file', 'replace_path',
           'save_atomically']

#: The top-level config key that allows loading checkpoints that need arbitrary globals.
UNSAFE_SWITCH = 'allow_unsafe_checkpoints'

# Bound at import: :mod:`.sources` swaps ``torch.load`` for this module's
# loader while mmengine's URI loaders run.
_torch_load = torch.load


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs globals that ``weights_only`` loading does not allow."""


def load_file(file: Union[str, IO[bytes]], allow_unsafe: bool = False) -> Any:
    """``torch.load`` to the CPU with ``weights_only=True``, unless the user opted out.

    ``file`` is a path or a readable binary stream (as mmengine's remote
    backends hand over). Files in torch's legacy (non-zip) format are refused
    unless ``allow_unsafe``: only the first bytes are looked at to tell.
    """
    name = file if isinstance(file, str) else getattr(file, 'name', 'the checkpoint stream')
    if _is_legacy_format(file):
        if not allow_unsafe:
            raise UnsafeCheckpointError(
                f'{name} is in torch\'s legacy (non-zip) format (saved by torch < 1.6 or with '
                '_use_new_zipfile_serialization=False), which mmfsdp loads only with '
                'weights_only=False. Nothing from the file was executed. If you trust this file, '
                f'set `{UNSAFE_SWITCH} = True` in the config, or re-save it with a current torch.')
    else:
        try:
            # mmap: tensors are paged in as they are read, so taking one shard of a
            # large full checkpoint does not hold the whole file in memory first.
            return _torch_load(file, map_location='cpu', weights_only=True,
                              mmap=isinstance(file, str))
        except pickle.UnpicklingError as e:
            if not allow_unsafe:
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                raise UnsafeCheckpointError(
                    f'{name} needs globals that safe loading (weights_only=True) rejects: '
                    f'{reason} Nothing from the file was executed. If you trust this file, set '
                    f'`{UNSAFE_SWITCH} = True` in the config to load it with weights_only=False.'
                ) from None
    warnings.warn(f'Loading {name} with weights_only=False ({UNSAFE_SWITCH}=True): '
                  'unpickling can execute arbitrary code', stacklevel=2)
    if not isinstance(file, str):
        file.seek(0)
    return _torch_load(file, map_location='cpu', weights_only=False)


def _is_legacy_format(file: Union[str, IO[bytes]]) -> bool:
    """Whether ``file`` starts like a pickle (torch's legacy format) rather than a zip archive."""
    if isinstance(file, str):
        with open(file, 'rb') as f:
            head = f.read(4)
    else:
        position = file.tell()
        head = file.read(4)
        file.seek(position)
    return head[:1] == b'\x80'  # pickle's PROTO opcode; zip archives start with b'PK'
