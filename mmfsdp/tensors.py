"""The one walk over the nested values models take and return.

Tensors are found in lists, tuples (named too), dicts and, with ``objects``,
the attributes of plain objects: mmengine's data samples
(``DetDataSample.pred_instances.bboxes``, ``SegDataSample.seg_logits.data``),
mmdet's boxes. The plan's trace and FSDP2's fp32 modules walk with it.
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


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating-point tensors (in lists, tuples, dicts) cast to ``dtype``."""
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t, False)
