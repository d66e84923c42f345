"""The one walk over the nested values models take and return.

Tensors are found in lists, tuples (named too), dicts and, with ``objects``,
the attributes of plain objects: mmengine's data samples
(``DetDataSample.pred_instances.bboxes``, ``SegDataSample.seg_logits.data``),
mmdet's boxes. The plan's trace, FSDP2's fp32 modules and the sharded
wrappers' predictions all walk with it.
"""
import copy
from typing import Any, Callable, List, Optional

import torch
from torch import nn


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any], objects: bool = True,
                memo: Optional[dict] = None) -> Any:
    """``value`` with each tensor ``t`` replaced by ``fn(t)``, copied only where one changed.

    A changed object is copied shallowly (its other attributes, a data
    sample's metainfo among them, stay the same objects); ``value`` itself is
    never modified.
    """
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        return fn(value)
    if id(value) in memo or isinstance(value, (nn.Module, type, str, bytes)) or callable(value):
        return memo.get(id(value), value)
    memo[id(value)] = value  # cycles end here
    if isinstance(value, (list, tuple)):
        items = [map_tensors(v, fn, objects, memo) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            memo[id(value)] = (type(value)(*items) if hasattr(value, '_fields')
                               else type(value)(items))
    elif isinstance(value, dict) or (objects and hasattr(value, '__dict__')):
        fields = value if isinstance(value, dict) else vars(value)
        items = {k: map_tensors(v, fn, objects, memo) for k, v in fields.items()}
        if any(items[k] is not v for k, v in fields.items()):
            memo[id(value)] = copy.copy(value)
            (memo[id(value)] if isinstance(value, dict) else vars(memo[id(value)])).update(items)
    return memo[id(value)]


def tensors(value: Any, objects: bool = False) -> List[torch.Tensor]:
    """The tensors in ``value``, found as by :func:`map_tensors`."""
    found: List[torch.Tensor] = []
    map_tensors(value, lambda t: found.append(t) or t, objects)
    return found


def cast_floats(value: Any, dtype: torch.dtype, below: int = 16, objects: bool = False) -> Any:
    """``value`` with its floating-point tensors of fewer than ``below`` bytes cast to ``dtype``.

    ``below=4, objects=True`` gives a model's bf16 / fp16 predictions (data
    samples, dicts, tuples, at any depth) as an fp32 model returns them, which
    a metric's ``.numpy()`` reads; integer tensors (labels) stay as they are.
    """
    return map_tensors(value, lambda t: t.to(dtype) if (
        t.is_floating_point() and t.dtype.itemsize < below) else t, objects)
