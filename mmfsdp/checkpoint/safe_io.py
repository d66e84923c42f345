"""Safe reading: ``weights_only`` loading from any location, and values it accepts.

Files are read with ``torch.load(weights_only=True)``; what needs more loads
only with ``allow_unsafe_checkpoints = True`` (:data:`UNSAFE_SWITCH`), with a
warning. :func:`encode` stores numpy values and the message hub's log scalars
as plain values, so mmfsdp's own files need no switch and stock readers get
the stock values; :func:`decode` restores them exactly. See
``docs/checkpoints.md``.
"""
import contextlib
import os
import pickle
import types
import warnings
from typing import IO, Any, Callable, Dict, Iterator, List, Mapping, Tuple, Union

import numpy as np
import torch
from mmengine.logging import HistoryBuffer
from mmengine.runner import CheckpointLoader

__all__ = ['ENCODING_KEY', 'UNSAFE_SWITCH', 'UnsafeCheckpointError', 'decode', 'encode',
           'load_file', 'read_checkpoint', 'unsafe_values', 'without_code']

#: The top-level config key that allows loading checkpoints that need arbitrary globals.
UNSAFE_SWITCH = 'allow_unsafe_checkpoints'
#: The top-level checkpoint key that records what :func:`encode` converted.
ENCODING_KEY = 'mmfsdp_encoding'

# Bound at import: read_checkpoint swaps ``torch.load`` for load_file while mmengine's
# URI loaders run.
_torch_load = torch.load


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint needs globals that ``weights_only`` loading does not allow."""


def load_file(file: Union[str, IO[bytes]], allow_unsafe: bool = False) -> Any:
    """``torch.load`` to the CPU with ``weights_only=True``, unless the user opted out.

    ``file`` is a path or a readable binary stream (as mmengine's remote
    backends hand over). Torch's legacy (non-zip) format is refused unless
    ``allow_unsafe``.
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
            # mmap: taking one shard of a large full checkpoint does not read the whole file
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
    if isinstance(file, str):
        with open(file, 'rb') as f:
            head = f.read(4)
    else:
        position = file.tell()
        head = file.read(4)
        file.seek(position)
    return head[:1] == b'\x80'  # pickle's PROTO opcode; zip archives start with b'PK'


def read_checkpoint(filename: str, allow_unsafe: bool = False) -> Any:
    """The object saved at ``filename``: a local path or anything mmengine's loader reads.

    URLs, zoo prefixes and storage backends go through mmengine's
    ``CheckpointLoader`` (its download cache and barriers: every rank must
    call); only the unpickling is :func:`load_file`. A refused file raises on
    every rank, after mmengine's download barrier.
    """
    if os.path.isfile(os.path.expanduser(filename)):
        return load_file(os.path.expanduser(filename), allow_unsafe)
    refused: List[UnsafeCheckpointError] = []

    def safe_load(f: Any, map_location: Any = None, **_: Any) -> Any:
        try:
            return load_file(f, allow_unsafe)
        except UnsafeCheckpointError as e:
            refused.append(e)
            return {}

    with _torch_load_replaced_by(safe_load):
        checkpoint = CheckpointLoader.load_checkpoint(filename, map_location='cpu')
    if refused:
        raise refused[0]
    return checkpoint


@contextlib.contextmanager
def _torch_load_replaced_by(load: Callable[..., Any]) -> Iterator[None]:
    # mmengine's scheme loaders (and torch.hub under them) end in torch.load with torch's
    # defaults; route it to the safe loader.
    original = torch.load
    torch.load = load
    try:
        yield
    finally:
        torch.load = original


# What a recorded path held: a numpy array, a numpy scalar, a HistoryBuffer.
_ARRAY, _SCALAR, _BUFFER = 'ndarray', 'numpy_scalar', 'history_buffer'
# Entries holding only tensors: nothing in them to encode or decode.
_TENSOR_ENTRIES = ('state_dict', 'optimizer')
# Tagged dicts of earlier mmfsdp versions.
_LEGACY_BUFFER, _LEGACY_NDARRAY = '__history_buffer__', '__ndarray__'
# Leaf types ``torch.load(weights_only=True)`` reads back.
_SAFE_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype,
                torch.device, torch.Size)

Path = Tuple[Any, ...]


def encode(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """``checkpoint`` with numpy values and ``HistoryBuffer`` objects as plain values.

    A numpy scalar becomes the Python number, an array a tensor of its dtype
    (a list if torch has none); the message hub's ``log_scalars`` move out of
    ``message_hub`` into the :data:`ENCODING_KEY` record, which also lists what
    was converted (the key is left out when nothing was).
    """
    plain: Dict[str, Any] = {}
    record: Dict[str, Any] = {}
    for entry, value in checkpoint.items():
        if entry in _TENSOR_ENTRIES:
            plain[entry] = value
            continue
        own: Dict[str, Any] = {}
        if entry == 'message_hub' and isinstance(value, Mapping) and value.get('log_scalars'):
            value, own['log_scalars'], own['resumed_keys'] = _split_message_hub(value)
        converted: Dict[Path, Tuple[str, str]] = {}
        plain[entry] = _plain(value, (), converted)
        if converted:
            own['converted'] = converted
        if own:
            record[entry] = own
    if record:
        plain[ENCODING_KEY] = record
    return plain


def decode(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`encode` (also of earlier versions' tagged dicts)."""
    record = checkpoint.get(ENCODING_KEY) or {}
    out: Dict[str, Any] = {}
    for entry, value in checkpoint.items():
        if entry == ENCODING_KEY:
            continue
        if entry in _TENSOR_ENTRIES:
            out[entry] = value
            continue
        own = record.get(entry, {})
        value = _restore(value, (), own.get('converted', {}))
        if 'log_scalars' in own:
            value = dict(value, log_scalars={k: _buffer(v) for k, v in own['log_scalars'].items()},
                         resumed_keys=dict(own['resumed_keys']))
        out[entry] = value
    return out


def _split_message_hub(state: Mapping[str, Any]) -> Tuple[dict, dict, dict]:
    """The message hub without its log scalars; the log scalars; all resumed keys."""
    scalars = state['log_scalars']
    resumed = dict(state.get('resumed_keys', {}))
    stock = dict(state, log_scalars={},
                 resumed_keys={k: v for k, v in resumed.items() if k not in scalars})
    return stock, {k: _buffer_plain(v) for k, v in scalars.items()}, resumed


def _buffer_plain(buffer: HistoryBuffer) -> Dict[str, Any]:
    history, counts = buffer.data
    return dict(log=_tensor(np.asarray(history)), count=_tensor(np.asarray(counts)),
                max_length=buffer.max_length)


def _buffer(value: Mapping[str, Any]) -> HistoryBuffer:
    return HistoryBuffer(_numpy(value['log']), _numpy(value['count']), value['max_length'])


def _tensor(array: np.ndarray) -> Any:
    """A tensor of the array's dtype and shape; a list if torch has no such dtype."""
    native = array.astype(array.dtype.newbyteorder('='), copy=False)
    try:
        return torch.from_numpy(np.ascontiguousarray(native).copy())
    except TypeError:  # strings, datetimes, ...: no tensor dtype
        return array.tolist()


def _numpy(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(_untag(value))


def _plain(value: Any, path: Path, converted: Dict[Path, Tuple[str, str]]) -> Any:
    if isinstance(value, (torch.Tensor, torch.Size)):
        return value
    if isinstance(value, HistoryBuffer):
        converted[path] = (_BUFFER, '')
        return _buffer_plain(value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        converted[path] = (_ARRAY, value.dtype.str)
        return _tensor(value)
    if isinstance(value, np.generic):
        converted[path] = (_SCALAR, value.dtype.str)
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v, path + (k,), converted) for k, v in value.items()}
    if isinstance(value, set):  # elements are hashable: numpy scalars become Python's
        return {v.item() if isinstance(v, np.generic) else v for v in value}
    if isinstance(value, (list, tuple)):  # namedtuples become plain tuples
        items = [_plain(v, path + (i,), converted) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _restore(value: Any, path: Path, converted: Mapping[Path, Tuple[str, str]]) -> Any:
    kind = converted.get(path)
    if kind is not None:
        what, dtype = kind
        if what == _BUFFER:
            return _buffer(value)
        array = np.asarray(_numpy(value), dtype=np.dtype(dtype))
        return array[()] if what == _SCALAR else array
    if isinstance(value, Mapping):
        if value.get(_LEGACY_NDARRAY) is True or value.get(_LEGACY_BUFFER) is True:
            return _untag(value)
        return {k: _restore(v, path + (k,), converted) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, path + (i,), converted) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_restore(v, path + (i,), converted) for i, v in enumerate(value))
    return value


def _untag(value: Any) -> Any:
    """A value as earlier mmfsdp versions stored it (a tagged dict)."""
    if isinstance(value, Mapping) and value.get(_LEGACY_NDARRAY) is True:
        array = np.frombuffer(value['data'].numpy().tobytes(), dtype=np.dtype(value['dtype']))
        array = array.reshape(value['shape']).copy()
        return array[()] if value.get('scalar') else array
    if isinstance(value, Mapping) and value.get(_LEGACY_BUFFER) is True:
        return _buffer(value)
    return value


def without_code(state: Mapping[str, Any]) -> dict:
    """A scheduler's ``state_dict()`` without functions and bound methods.

    ``OneCycleParamScheduler`` stores ``anneal_func`` (a bound method); its
    constructor sets it again from the config, so leaving it out loses nothing.
    """
    code = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
    return {k: v for k, v in state.items() if not isinstance(v, code)}


def unsafe_values(value: Any, path: str = 'checkpoint') -> Iterator[Tuple[str, type]]:
    """``(key path, type)`` of every value that ``weights_only`` loading would refuse."""
    if isinstance(value, _SAFE_LEAVES):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from unsafe_values(v, f'{path}[{k!r}]')
    elif isinstance(value, (list, tuple, set)):
        for i, v in enumerate(value):
            yield from unsafe_values(v, f'{path}[{i}]')
    else:
        yield path, type(value)
