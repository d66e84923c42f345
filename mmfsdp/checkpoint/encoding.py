"""Checkpoint values as tensors and plain Python values, which ``weights_only`` loading accepts.

``torch.load(weights_only=True)`` accepts tensors, numbers, strings, ``None``
and dicts / lists / tuples / sets of them, and refuses any other pickled
global. What mmengine puts into a checkpoint besides tensors is not all of that
kind: the message hub holds ``HistoryBuffer`` objects, ``dataset_meta`` often
holds numpy arrays (palettes, keypoint sigmas), and ``OneCycleLR`` keeps a bound
method in its state. :func:`encode` turns such values into accepted ones and
:func:`decode` restores them, exactly (same dtype, shape and values), so the
stock Runner's comparisons after a resume (``dataset_meta`` by pickle) hold.

Example::

    >>> meta = dict(palette=np.zeros((2, 3), np.uint8))
    >>> decode(torch.load(save(encode(meta)), weights_only=True))  # the same arrays back
"""
import types
from typing import Any, Iterator, Mapping, Tuple

import numpy as np
import torch
from mmengine.logging import HistoryBuffer

__all__ = ['decode', 'encode', 'unsafe_values', 'without_code']

_BUFFER = '__history_buffer__'
_NDARRAY = '__ndarray__'

#: Leaf types ``torch.load(weights_only=True)`` reads back.
_SAFE_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype,
                torch.device, torch.Size)


def encode(value: Any) -> Any:
    """``value`` with ``HistoryBuffer``s and numpy values replaced by plain ones."""
    if isinstance(value, (torch.Tensor, torch.Size)):
        return value
    if isinstance(value, HistoryBuffer):
        history, counts = value.data
        return {_BUFFER: True, 'log': encode(np.asarray(history, dtype=np.float64)),
                'count': encode(np.asarray(counts, dtype=np.float64)),
                'max_length': value.max_length}
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype != object:
        return {_NDARRAY: True, 'dtype': value.dtype.str, 'shape': tuple(np.shape(value)),
                'data': torch.from_numpy(np.frombuffer(value.tobytes(), np.uint8).copy()),
                'scalar': isinstance(value, np.generic)}
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):  # namedtuples become plain tuples
        plain = list if isinstance(value, list) else set if isinstance(value, set) else tuple
        return plain(encode(v) for v in value)
    return value


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`; anything else passes through unchanged."""
    if isinstance(value, Mapping):
        if value.get(_NDARRAY) is True:
            raw = value['data'].numpy().tobytes()
            array = np.frombuffer(raw, dtype=np.dtype(value['dtype'])).reshape(
                value['shape']).copy()
            return array[()] if value.get('scalar') else array
        if value.get(_BUFFER) is True:
            return HistoryBuffer(_array(value['log']), _array(value['count']),
                                 value['max_length'])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v) for v in value)
    return value


def _array(value: Any) -> np.ndarray:
    # Tensors: HistoryBuffers as mmfsdp versions before the ndarray encoding stored them.
    return value.numpy() if isinstance(value, torch.Tensor) else decode(value)


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
