"""The batch a traced step runs on, from the config's dataset or ``--input-shape``.

One sample, collated and preprocessed as ``train_step`` does (``docs/plan.md``).
"""
import functools
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
from mmengine.registry import DATASETS, FUNCTIONS, DefaultScope
from torch import nn

from .trace import BatchFn

__all__ = ['config_batch', 'shape_batch']

KEY = 'train_dataloader'


def config_batch(dataloader_cfg: Mapping[str, Any], scope: str,
                 batch_size: Optional[int] = None) -> Tuple[BatchFn, int]:
    """The batch of a ``train_dataloader`` config: ``(batch function, batch size)``."""
    if not dataloader_cfg or 'dataset' not in dataloader_cfg:
        raise ValueError(f'{KEY}.dataset: the config has no training dataset to take a sample '
                         'from; pass --input-shape to give the inputs directly')
    size = int(batch_size or dataloader_cfg.get('batch_size', 1))
    collate_cfg = dict(dataloader_cfg.get('collate_fn') or dict(type='pseudo_collate'))
    with DefaultScope.overwrite_default_scope(scope):
        dataset = DATASETS.build(dataloader_cfg['dataset'])
        kind = collate_cfg.pop('type')
        collate = FUNCTIONS.get(kind) if isinstance(kind, str) else kind
    if collate is None:
        raise ValueError(f'{KEY}.collate_fn.type={kind!r} is not a registered function')
    if len(dataset) == 0:
        raise ValueError(f'{KEY}.dataset is empty: no sample to shape the batch with')
    samples = [dataset[0]] * size
    data = functools.partial(collate, **collate_cfg)(samples)

    def batch(model: nn.Module) -> Tuple[tuple, Dict[str, Any]]:
        processed = model.data_preprocessor(data, True)
        if isinstance(processed, Mapping):
            return (), dict(processed, mode='loss')
        return tuple(processed), dict(mode='loss')

    return batch, size


def shape_batch(shape: Sequence[int], dtype: torch.dtype = torch.float32,
                batch_size: Optional[int] = None) -> Tuple[BatchFn, int]:
    """Inputs of ``shape`` (its first dimension replaced by ``batch_size``), ``mode='tensor'``."""
    shape = [int(batch_size or shape[0]), *map(int, shape[1:])]

    def batch(model: nn.Module) -> Tuple[tuple, Dict[str, Any]]:
        if dtype.is_floating_point:
            inputs = torch.empty(shape, dtype=dtype).normal_()
        else:  # token ids: small non-negative integers index any embedding
            inputs = torch.zeros(shape, dtype=dtype)
        processed = model.data_preprocessor(dict(inputs=inputs), True)
        return (), dict(inputs=processed['inputs'], mode='tensor')

    return batch, shape[0]
