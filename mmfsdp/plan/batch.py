"""The batch a traced step runs on, from the config's dataset or ``--input-shape``.

One sample, collated and preprocessed as ``train_step`` does, through the
pipeline at its largest scale (``docs/plan.md``).
"""
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from mmengine.registry import DATASETS, FUNCTIONS, DefaultScope
from torch import nn

from .trace import BatchFn

__all__ = ['config_batch', 'largest_pipeline', 'shape_batch', 'worst_case_dataset']

KEY = 'train_dataloader'


def _pair(scale: Any) -> Tuple[int, int]:
    return (scale, scale) if isinstance(scale, (int, float)) else tuple(scale)


def _largest(transform: Mapping[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """The transforms that produce ``transform``'s largest image (``None``: it draws no size).

    mmcv's and mmdet's conventions: a scale is (w, h), or (long, short) edges
    under ``keep_ratio``, whose largest image has the aspect ratio of the scale
    itself: a ``Resize`` to exactly that scale. ``RandomResize`` draws each
    edge between its two scales, or multiplies one by a ratio of
    ``ratio_range``; ``RandomCrop`` sizes are (h, w).
    """
    kind = str(transform.get('type', '')).split('.')[-1]
    keep, crop = transform.get('keep_ratio', False), transform.get('crop_type')
    if kind == 'RandomCrop' and crop == 'relative_range':
        return []  # a fraction of the image up to all of it: the whole image
    if kind == 'RandomCrop' and crop == 'absolute_range':
        return [dict(transform, crop_type='absolute', crop_size=(max(transform['crop_size']),) * 2)]
    if kind == 'RandomChoice':
        return max((largest_pipeline(branch)[0] for branch in transform['transforms']),
                   key=_area)
    if kind == 'RandomChoiceResize':
        scales = [_pair(s) for s in transform['scales']]
    elif kind == 'RandomResize' and transform.get('ratio_range'):
        scales = [tuple(e * max(transform['ratio_range']) for e in _pair(transform['scale']))]
    elif kind == 'RandomResize':
        edges = [_pair(s) for s in transform['scale']]
        scales = [(max(map(max, edges)), max(map(min, edges)))]
    elif kind == 'Resize' and keep and transform.get('scale') is not None:
        scales = [_pair(transform['scale'])]
    else:
        return None
    w, h = max(((max(s), min(s)) if keep else s for s in scales), key=lambda s: s[0] * s[1])
    kept = {k: v for k, v in transform.items()
            if k not in ('type', 'scale', 'scales', 'ratio_range', 'keep_ratio', 'resize_type')}
    resize = transform['type'] if kind == 'Resize' else transform.get('resize_type', 'Resize')
    return [dict(kept, type=resize, scale=(int(w), int(h)), keep_ratio=False)]


def _area(pipeline: Sequence[Mapping[str, Any]]) -> int:
    """The area of the image a rewritten pipeline ends with (0: it sets no size)."""
    w = h = 0
    for t in pipeline:
        kind = str(t.get('type', '')).split('.')[-1]
        if t.get('scale') is not None and not t.get('keep_ratio', False):
            w, h = _pair(t['scale'])
        elif kind == 'RandomCrop' and t.get('crop_type', 'absolute') == 'absolute' and w:
            w, h = min(w, t['crop_size'][1]), min(h, t['crop_size'][0])
    return w * h


def largest_pipeline(pipeline: Sequence[Any], notes: Optional[List[str]] = None
                     ) -> Tuple[List[Any], List[str]]:
    """``pipeline`` (a list of transform configs, left as it is) drawing its largest images.

    Returns the new list and a note per transform changed (appended to ``notes``).
    """
    out: List[Any] = []
    notes = [] if notes is None else notes
    for transform in pipeline:
        largest = _largest(transform) if isinstance(transform, Mapping) else None
        out += [transform] if largest is None else largest
        if largest is not None:
            sizes = (t.get('scale', t.get('crop_size', ())) for t in largest)
            made = ', '.join(f"{t['type']} {'x'.join(map(str, s))}" for t, s in zip(largest, sizes))
            notes.append(f"{transform['type']} -> {made or 'none'}")
    return out, notes


def worst_case_dataset(dataset_cfg: Any) -> Tuple[Any, List[str]]:
    """A copy of a dataset config whose every ``pipeline`` draws its largest images.

    Detection and segmentation pipelines draw a scale per sample
    (``RandomChoiceResize``, ``RandomResize``, crops); one sample at a drawn
    scale under-predicts the step. Returns the copy and what changed.
    """
    notes: List[str] = []

    def walk(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: largest_pipeline(v, notes)[0] if k == 'pipeline' else walk(v)
                    for k, v in value.items()}
        return [walk(v) for v in value] if isinstance(value, (list, tuple)) else value

    return walk(dataset_cfg), notes


def config_batch(dataloader_cfg: Mapping[str, Any], scope: str,
                 batch_size: Optional[int] = None,
                 notes: Optional[List[str]] = None) -> Tuple[BatchFn, int]:
    """The batch of a ``train_dataloader`` config: ``(batch function, batch size)``.

    The pipeline draws its largest images (:func:`worst_case_dataset`); what
    that changed is appended to ``notes``.
    """
    if not dataloader_cfg or 'dataset' not in dataloader_cfg:
        raise ValueError(f'{KEY}.dataset: the config has no training dataset to take a sample '
                         'from; pass --input-shape to give the inputs directly')
    size = int(batch_size or dataloader_cfg.get('batch_size', 1))
    collate_cfg = dict(dataloader_cfg.get('collate_fn') or dict(type='pseudo_collate'))
    with DefaultScope.overwrite_default_scope(scope):
        dataset_cfg, changed = worst_case_dataset(dataloader_cfg['dataset'])
        dataset = DATASETS.build(dataset_cfg)
        kind = collate_cfg.pop('type')
        collate = FUNCTIONS.get(kind) if isinstance(kind, str) else kind
    if collate is None:
        raise ValueError(f'{KEY}.collate_fn.type={kind!r} is not a registered function')
    if len(dataset) == 0:
        raise ValueError(f'{KEY}.dataset is empty: no sample to shape the batch with')
    if notes is not None:
        notes.extend(changed)
    data = collate([dataset[0]] * size, **collate_cfg)

    def batch(model: nn.Module) -> Tuple[tuple, Dict[str, Any]]:
        processed = model.data_preprocessor(data, True)
        return (((), dict(processed, mode='loss')) if isinstance(processed, Mapping)
                else (tuple(processed), dict(mode='loss')))

    return batch, size


def shape_batch(shape: Sequence[int], dtype: torch.dtype = torch.float32,
                batch_size: Optional[int] = None) -> Tuple[BatchFn, int]:
    """Inputs of ``shape`` (its first dimension replaced by ``batch_size``), ``mode='tensor'``."""
    shape = [int(batch_size or shape[0]), *map(int, shape[1:])]

    def batch(model: nn.Module) -> Tuple[tuple, Dict[str, Any]]:
        # token ids (not floats): small non-negative integers index any embedding
        inputs = (torch.randn if dtype.is_floating_point else torch.zeros)(shape, dtype=dtype)
        processed = model.data_preprocessor(dict(inputs=inputs), True)
        return (), dict(inputs=processed['inputs'], mode='tensor')

    return batch, shape[0]
