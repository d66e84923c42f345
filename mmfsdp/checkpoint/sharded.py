"""Sharded checkpoints: a directory that every rank writes its shards into.

Layout of ``iter_N.pth/`` (the path a full checkpoint file would have)::

    .metadata, __<rank>_0.distcp   torch.distributed.checkpoint: model + optimizer tensors
                                   (+ ``ema``: see :mod:`mmfsdp.ema`)
    mmengine.pth                   meta, message hub, schedulers, optimizer param groups
                                   and optim-wrapper extras (plain values, weights_only-safe)

The directory is written as ``<token>-iter_N.pth.tmp/`` and renamed once every rank
has finished, so a directory under the final name is always complete. It loads
at any world size, and without a process group (see :mod:`mmfsdp.consolidate`).
"""
import contextlib
import os
import shutil
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mmengine.dist import is_main_process
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..optim_wrappers import AnyOptimWrapper, named_optim_wrappers
from ..together import control_group, fail_together
from .durable import remove_stale_temporaries, temporary_path
from .matching import KeyMatch, match_keys
from .safe_io import load_file, replace_path, save_atomically
from .state import (
    _options,
    load_optimizer_extras,
    load_param_groups,
    optimizer_template,
    sharded_state,
)

__all__ = ['META_FILE', 'check_shared_directory', 'checkpoint_model_shapes',
           'is_sharded_checkpoint', 'load_sharded', 'read_sharded_meta', 'save_sharded']

#: The file of a sharded checkpoint that holds everything but the shards.
META_FILE = 'mmengine.pth'

# Top-level keys of the shards, as DCP flattens them into its metadata.
_MODEL, _OPTIMIZER = 'model.', 'optimizer.'


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete sharded checkpoint directory."""
    return os.path.isfile(os.path.join(path, META_FILE))


def save_sharded(path: str, model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper],
                 extra: Dict[str, Any], wait_s: Optional[float] = None,
                 extra_shards: Optional[Dict[str, Any]] = None, token: str = '',
                 clean_tokens: Sequence[str] = ()) -> None:
    """Write every rank's shards and rank 0's ``extra`` to the directory ``path`` (collective).

    Rank 0's own steps (clearing a stale temporary directory, writing the meta
    file, renaming) end in :func:`~mmfsdp.together.fail_together`: if they
    fail, every rank raises. ``wait_s`` bounds how long the other ranks wait
    for rank 0's writes. ``extra_shards`` are saved beside the model and
    optimizer shards (e.g. ``EMAHook``'s, under ``'ema'``). ``token`` names
    the temporaries (:func:`~.durable.temporary_path`); after the rename,
    those of ``clean_tokens`` are removed. The first save into a directory
    checks that every rank sees it (:func:`check_shared_directory`).
    """
    directory = os.path.dirname(os.path.abspath(path))
    check_shared_directory(directory, token)
    tmp = temporary_path(path, token)
    with fail_together(f'clearing {tmp}'):
        if is_main_process() and os.path.isdir(tmp):
            shutil.rmtree(tmp)
    shards, param_groups = sharded_state(model, optim_wrapper)
    shards.update(extra_shards or {})
    with _single_process_is_intended():
        dcp.save(shards, checkpoint_id=tmp)
    with fail_together(f'saving checkpoint {path}', wait_s):
        if is_main_process():
            if param_groups is not None:
                extra = dict(extra, optimizer_param_groups=param_groups)
            save_atomically(extra, os.path.join(tmp, META_FILE))
            replace_path(tmp, path, token)
            remove_stale_temporaries(directory, clean_tokens)


#: Directories that every rank of this process's job was seen to share.
_SHARED_DIRECTORIES: Set[str] = set()


def check_shared_directory(directory: str, token: str = '') -> None:
    """Refuse, on every rank and before anything is written, a directory the ranks do not share.

    Every rank writes its shards into the same directory and rank 0 renames
    it: on node-local disks, the other nodes' shards would stay behind under
    the temporary name and a resume would fail later on missing files. So at
    the first sharded save into ``directory``, rank 0 writes a marker file
    there, every rank looks for it, and the ranks agree on what they saw
    (one gather); rank 0 removes the marker. Collective; once per directory
    and process.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or \
            directory in _SHARED_DIRECTORIES:
        return
    marker = temporary_path(os.path.join(directory, 'shared-directory-check'), token)
    with fail_together(f'writing {marker}'):
        if is_main_process():
            os.makedirs(directory, exist_ok=True)
            with open(marker, 'w') as f:
                f.write('written by rank 0 to check that every rank sees this directory\n')
    seen: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (os.path.isfile(marker), directory), group=control_group())
    with fail_together(f'removing {marker}'):
        if is_main_process():
            os.remove(marker)
    blind = [rank for rank, (saw, _) in enumerate(seen) if not saw]
    if blind:  # the same message on every rank
        raise ValueError(
            f"default_hooks.checkpoint: state_dict_type='sharded' writes every rank's shards "
            f'into one directory ({seen[0][1]} on rank 0), but rank'
            f'{"s" if len(blind) > 1 else ""} {", ".join(map(str, blind))} did not see the '
            f'file rank 0 wrote there (in {seen[blind[0]][1]} on rank {blind[0]}): the ranks '
            'do not share this directory (a disk local to each node?). Nothing was written. '
            'Choose a work_dir (or the hook\'s out_dir) on a file system that every node '
            "mounts, or state_dict_type='full' (one file, written by rank 0 alone); "
            "state_dict_type choices: 'full', 'sharded'.")
    _SHARED_DIRECTORIES.add(directory)


def read_sharded_meta(path: str, allow_unsafe: bool = False) -> Dict[str, Any]:
    """The non-shard part of a sharded checkpoint: meta, message hub, schedulers."""
    return load_file(os.path.join(path, META_FILE), allow_unsafe)


def checkpoint_model_shapes(path: str) -> Dict[str, Optional[torch.Size]]:
    """The model keys and full shapes stored in a sharded checkpoint (reads only ``.metadata``)."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {key[len(_MODEL):]: getattr(entry, 'size', None)
            for key, entry in metadata.items() if key.startswith(_MODEL)}


def _optimizers_with_shards(path: str, optim_wrapper: AnyOptimWrapper) -> List[Optional[str]]:
    """The optim wrappers (by name) whose optimizer state the sharded checkpoint holds.

    An optimizer that had no state when saved (SGD without momentum, or
    before its first step) has no shards.
    """
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    names = [name for name, _ in named_optim_wrappers(optim_wrapper)]
    return [name for name in names
            if any(k.startswith(_OPTIMIZER if name is None else f'{_OPTIMIZER}{name}.')
                   for k in keys)]


def load_sharded(path: str, model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper] = None,
                 match: Optional[KeyMatch] = None, meta: Optional[Dict[str, Any]] = None) -> None:
    """Load the model (and the optimizer) from a sharded checkpoint, at any world size.

    Each rank reads the pieces of the saved shards that overlap its own.
    ``match`` (:func:`~.matching.match_keys`) says which checkpoint entry goes
    into which model key; without it every key must match exactly. ``meta`` is
    the checkpoint's :data:`META_FILE` content, needed for the optimizer
    (param groups, optim-wrapper extras).
    """
    options = _options(model, full=False)
    own = get_model_state_dict(model, options=options)
    if match is None:
        match = match_keys({k: None for k in own}, {k: None for k in own})
    template: Dict[str, Any] = dict(model={saved: own[key] for key, saved in match.loaded.items()})
    with_shards = [] if optim_wrapper is None else _optimizers_with_shards(path, optim_wrapper)
    wrappers = dict(named_optim_wrappers(optim_wrapper)) if optim_wrapper is not None else {}
    if with_shards == [None]:
        template['optimizer'] = optimizer_template(model, wrappers[None].optimizer)
    elif with_shards:
        template['optimizer'] = {name: optimizer_template(model, wrappers[name].optimizer)
                                 for name in with_shards}
    with _single_process_is_intended():
        dcp.load(template, checkpoint_id=path)
    loaded = {key: template['model'][saved] for key, saved in match.loaded.items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    if optim_wrapper is None:
        return
    meta = meta if meta is not None else read_sharded_meta(path)
    groups, extras = meta['optimizer_param_groups'], meta.get('optimizer_extras') or {}
    for name, wrapper in wrappers.items():
        own_groups = _select(groups, name)
        if name in with_shards:
            state = dict(state=_select(template['optimizer'], name)['state'],
                         param_groups=own_groups)
            load_param_groups(wrapper.optimizer, own_groups)  # checks the parameter counts
            set_optimizer_state_dict(model, wrapper.optimizer, state, options=options)
        else:  # saved without optimizer state: DCP's template step must not leave any
            wrapper.optimizer.state.clear()
            load_param_groups(wrapper.optimizer, own_groups)
        load_optimizer_extras(wrapper, _select(extras, name) if extras else {})


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to load/save in a single process" warning.

    Without a process group DCP warns on every call (also with ``no_dist=True``);
    one-process use of a sharded checkpoint (``tools/test.py --launcher none``)
    is intended here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', category=UserWarning,
                                message='torch.distributed is disabled, unavailable or '
                                        'uninitialized, assuming the intent')
        yield


def _select(tree: Any, name: Optional[str]) -> Any:
    """The part of a per-optim-wrapper tree that belongs to wrapper ``name``."""
    return tree if name is None else tree[name]
