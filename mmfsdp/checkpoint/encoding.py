"""Checkpoint values that ``weights_only`` loading accepts and stock readers understand.

``torch.load(weights_only=True)`` accepts tensors, numbers, strings, ``None``
and dicts / lists / tuples / sets of them, and refuses any other pickled
global (no allow-list is needed for such a file). What mmengine puts into a
checkpoint besides tensors is not all of that kind: the message hub holds
``HistoryBuffer`` objects, ``dataset_meta`` often holds numpy arrays (palettes,
keypoint sigmas), and ``OneCycleLR`` keeps a bound method in its state.

:func:`encode` writes each such value where it was, as the plain value closest
to it, so that a stock reader (plain ``torch.load``, mmengine's
``load_checkpoint``, ``MessageHub.load_state_dict``, the stock
``Runner.resume``) gets what the stock Runner's own checkpoint would give it:

- a numpy scalar becomes the Python number (``np.float64(1.5)`` -> ``1.5``);
- a numpy array becomes a tensor of the same dtype and shape (``np.asarray``
  of it is the array again); arrays of a dtype torch lacks become lists;
- the message hub's ``log_scalars`` (``HistoryBuffer`` objects, which
  ``MessageHub.load_state_dict`` takes only as instances of that class) are
  left out of ``message_hub``, with their ``resumed_keys``; its
  ``runtime_info`` (iteration, epoch, kept and best checkpoints, best score)
  stays. A stock reader thus restores everything but the logging windows,
  without a warning; this is the one thing a ``weights_only`` file cannot carry
  to it.

What was converted is recorded under :data:`ENCODING_KEY` (the key is left
out when nothing was), together with the log scalars; :func:`decode`
restores every value exactly (numpy type, dtype, shape, ``HistoryBuffer``), so
the stock Runner's comparisons after an mmfsdp resume (``dataset_meta`` by
pickle) hold. Checkpoints of earlier mmfsdp versions, which stored tagged
dicts in place, still decode.

Example::

    >>> ckpt = encode(dict(meta=dict(palette=np.zeros((2, 3), np.uint8), seed=1)))
    >>> ckpt['meta']['palette']            # tensor([[0, 0, 0], [0, 0, 0]], dtype=torch.uint8)
    >>> decode(ckpt)['meta']['palette']    # array([[0, 0, 0], [0, 0, 0]], dtype=uint8)
"""
import types
from typing import Any, Dict, Iterator, Mapping, Tuple

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

__all__ = ['ENCODING_KEY', 'decode', 'encode', 'unsafe_values', 'without_code']

#: The top-level checkpoint key that records what :func:`encode` converted.
ENCODING_KEY = 'mmfsdp_encoding'

# What a recorded path held: a numpy array, a numpy scalar, a HistoryBuffer.
_ARRAY, _SCALAR, _BUFFER = 'ndarray', 'numpy_scalar', 'history_buffer'
# Entries holding only tensors: nothing in them to encode or decode.
_TENSOR_ENTRIES = ('state_dict', 'optimizer')
# Tagged dicts of earlier mmfsdp versions.
_LEGACY_BUFFER, _LEGACY_NDARRAY = '__history_buffer__', '__ndarray__'

#: Leaf types ``torch.load(weights_only=True)`` reads back.
_SAFE_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype,
                torch.device, torch.Size)

Path = Tuple[Any, ...]


def encode(checkpoint: Mapping[str, Any]) -> Dict[str, Any]:
    """``checkpoint`` with numpy values and ``HistoryBuffer`` objects as plain values."""
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
    """The inverse of :func:`encode`; a checkpoint without its record passes through."""
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
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(_legacy(value))


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
            return _legacy(value)
        return {k: _restore(v, path + (k,), converted) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v, path + (i,), converted) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return tuple(_restore(v, path + (i,), converted) for i, v in enumerate(value))
    return value


def _legacy(value: Any) -> Any:
    """Values as mmfsdp versions before the plain encoding stored them (tagged dicts)."""
    if isinstance(value, Mapping):
        if value.get(_LEGACY_NDARRAY) is True:
            raw = value['data'].numpy().tobytes()
            array = np.frombuffer(raw, dtype=np.dtype(value['dtype'])).reshape(
                value['shape']).copy()
            return array[()] if value.get('scalar') else array
        if value.get(_LEGACY_BUFFER) is True:
            return HistoryBuffer(_numpy(value['log']), _numpy(value['count']),
                                 value['max_length'])
        return {k: _legacy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_legacy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_legacy(v) for v in value)
    return value


def without_code(state: Mapping[str, Any]) -> dict:
    """A scheduler's ``state_dict()`` without functions and bound methods.

    mmengine's ``OneCycleParamScheduler`` stores ``anneal_func`` (a bound
    method) in its state; the constructor sets it again from the config, and
    ``load_state_dict`` updates ``__dict__``, so leaving it out loses nothing.
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
