"""``init_cfg=dict(type='Pretrained', ...)`` on sharded parameters.

mmengine's ``PretrainedInit`` loads a whole state dict into a whole module;
on shards that cannot work (a DTensor takes no full tensor). While
:func:`sharded_pretrained` is active, ``PretrainedInit`` keeps its place in
mmengine's ``init_weights`` order but loads this way instead:

- a local file is opened with ``torch.load(mmap=True)``: tensors are paged in
  as they are read, and each rank copies only its slice of each tensor (the
  rows of its shard), so no rank reads the whole file into memory;
- ``prefix`` and ``strict=False`` behave as in mmengine: keys are taken from
  ``state_dict`` (or the top level), ``module.`` is stripped, with ``prefix``
  only keys under it are used (an error if there are none); missing,
  unexpected and mis-shaped keys are skipped with one warning;
- ``map_location`` is accepted: the file is read on the CPU and each slice
  copied to the parameter's device, which gives the same values.

Other ``init_cfg`` types must be known to work on shards
(:data:`SHARD_SAFE_INIT_TYPES`, mmengine's built-ins, which act elementwise
or through a tensor's global shape); :func:`check_init_cfgs` rejects any other
at wrap time, naming the module and the type.
"""
import contextlib
import contextvars
import logging
import os.path as osp
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmengine.model.weight_init import PretrainedInit
from torch import nn

from ..compat import pretrained_init_calls, record_init_info
from .written import class_name, local_tensor

__all__ = ['SHARD_SAFE_INIT_TYPES', 'check_init_cfgs', 'load_pretrained', 'local_part',
           'sharded_pretrained']

#: ``init_cfg`` types that work on DTensor shards (mmengine's built-in initialisers).
SHARD_SAFE_INIT_TYPES = ('Constant', 'Xavier', 'Normal', 'TruncNormal', 'Uniform', 'Kaiming',
                         'Caffe2Xavier', 'Pretrained')

_ALLOW_UNSAFE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    'mmfsdp_pretrained_allow_unsafe', default=False)


def _type_name(cfg_type: Any) -> str:
    return cfg_type if isinstance(cfg_type, str) else getattr(cfg_type, '__name__', str(cfg_type))


def _init_cfgs(init_cfg: Any) -> Iterator[Mapping]:
    for cfg in init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]:
        if isinstance(cfg, Mapping):
            yield cfg
            overrides = cfg.get('override') or []
            for override in overrides if isinstance(overrides, (list, tuple)) else [overrides]:
                if isinstance(override, Mapping) and 'type' in override:
                    yield override


def check_init_cfgs(model: nn.Module) -> None:
    """Raise if an ``init_cfg`` type of any module may not work on shards."""
    for name, module in model.named_modules():
        if not isinstance(module, BaseModule) or not module.init_cfg:
            continue
        for cfg in _init_cfgs(module.init_cfg):
            kind = _type_name(cfg.get('type'))
            if kind not in SHARD_SAFE_INIT_TYPES and kind != 'PretrainedInit':
                raise ValueError(
                    f"init_device='meta': module `{name or '(root)'}` "
                    f'({class_name(module)}) has init_cfg type {kind!r}, which is not known '
                    f'to work on sharded parameters (supported: {", ".join(SHARD_SAFE_INIT_TYPES)}'
                    '). Initialise it in `init_weights`, provide the weights via `load_from`, '
                    'or leave init_device unset to initialise the full model before sharding.')


def local_part(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The slice of ``full`` that ``target`` (a DTensor shard, or a plain tensor) holds.

    Shards follow ``torch.chunk`` along the placement's dim, as DTensor and
    FSDP2 lay them out; a view, so an mmap-backed ``full`` reads only the slice.
    """
    mesh = getattr(target, 'device_mesh', None)
    if mesh is None:
        return full
    part = full
    for mesh_dim, placement in enumerate(target.placements):
        if placement.is_shard():
            count, coordinate = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
            chunks = torch.chunk(part, count, dim=placement.dim)
            part = (chunks[coordinate] if coordinate < len(chunks)
                    else part.narrow(placement.dim, 0, 0))
        elif not placement.is_replicate():
            raise NotImplementedError(f'cannot place a full tensor as {placement}')
    return part


def _read(filename: str, cache: Dict[str, Any]) -> Mapping[str, torch.Tensor]:
    if filename not in cache:
        if osp.isfile(filename):
            from ..checkpoint.safe_io import load_file
            try:
                checkpoint = load_file(filename, _ALLOW_UNSAFE.get())
            except RuntimeError:  # a legacy (non-zip) file cannot be memory-mapped
                checkpoint = torch.load(filename, map_location='cpu',
                                        weights_only=not _ALLOW_UNSAFE.get())
        else:
            from mmengine.runner import CheckpointLoader
            checkpoint = CheckpointLoader.load_checkpoint(filename, map_location='cpu')
        state = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, Mapping) \
            else checkpoint
        cache[filename] = state
    return cache[filename]


@torch.no_grad()
def load_pretrained(module: nn.Module, filename: str, prefix: Optional[str] = None,
                    cache: Optional[Dict[str, Any]] = None) -> List[str]:
    """Copy each rank's slice of a pretrained checkpoint into ``module``; returns the keys loaded.

    mmengine's semantics (``strict=False``): see the module docstring.
    """
    state = _read(filename, {} if cache is None else cache)
    if prefix is None:
        state = {re.sub(r'^module\.', '', k): v for k, v in state.items()}
    else:
        head = prefix if prefix.endswith('.') else prefix + '.'
        state = {k[len(head):]: v for k, v in state.items() if k.startswith(head)}
        if not state:
            raise ValueError(f'init_cfg Pretrained: prefix {prefix!r} is not in the pretrained '
                             f'model {filename}')
    targets = module.state_dict(keep_vars=True)
    loaded, mismatched = [], []
    for key, target in targets.items():
        source = state.get(key)
        if not isinstance(source, torch.Tensor):
            continue
        if tuple(source.shape) != tuple(target.shape):
            mismatched.append(f'{key}: {tuple(source.shape)} vs {tuple(target.shape)}')
            continue
        local_tensor(target).copy_(local_part(source, target))
        loaded.append(key)
    missing = [k for k in targets if k not in loaded and k not in state]
    unexpected = [k for k in state if k not in targets]
    if missing or unexpected or mismatched:
        print_log(f'init_cfg Pretrained {filename}: missing keys {missing}, unexpected keys '
                  f'{unexpected}, shape mismatches {mismatched}', logger='current',
                  level=logging.WARNING)
    return loaded


@contextlib.contextmanager
def sharded_pretrained(allow_unsafe: Optional[bool] = None) -> Iterator[None]:
    """Inside, mmengine's ``PretrainedInit`` loads through :func:`load_pretrained`."""
    cache: Dict[str, Any] = {}

    def call(self: PretrainedInit, module: nn.Module) -> None:
        print_log(f'load {self.prefix or "model"} from {self.checkpoint} (sharded)',
                  logger='current')
        load_pretrained(module, self.checkpoint, self.prefix, cache)
        record_init_info(self, module)

    token = _ALLOW_UNSAFE.set(bool(allow_unsafe) if allow_unsafe is not None
                              else _ALLOW_UNSAFE.get())
    try:
        with pretrained_init_calls(call):
            yield
    finally:
        _ALLOW_UNSAFE.reset(token)


@contextlib.contextmanager
def allow_unsafe_pretrained(allow: bool) -> Iterator[None]:
    """Let ``init_cfg`` Pretrained read checkpoints that need unsafe unpickling."""
    token = _ALLOW_UNSAFE.set(allow)
    try:
        yield
    finally:
        _ALLOW_UNSAFE.reset(token)
