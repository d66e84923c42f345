"""Model and optimizer state in both formats: a full file or a sharded directory.

Everything goes through ``torch.distributed.checkpoint.state_dict``, which
serves FSDP1, FSDP2, DDP and plain modules alike and keys everything by the
unwrapped model's parameter names, so both formats load at any world size and
into any wrapper. Gathering, scattering and sharded saves are collectives.

A sharded checkpoint ``iter_N.pth/`` holds DCP's ``.metadata`` and shard files
(model, optimizer, and extra shards such as ``ema``) and :data:`META_FILE`
(everything else, as plain values). Entries that every rank holds whole
(buffers such as BatchNorm's running statistics, which each rank updates for
itself) are rank 0's in both formats, as in mmengine's stock checkpoint.
:func:`match_keys` is mmengine's
``load_from`` rule (skip and list what does not fit), decided from names and
shapes before any tensor is read.

Checkpoints hold what the model's own ``state_dict()`` returns, under every
wrapper: a model whose class narrows it (XTuner's LoRA model returns its adapter)
saves, loads and resumes those keys only (:func:`mmfsdp.names.note_checkpoint_keys`).
"""
import contextlib
import copy
import dataclasses
import enum
import os
import re
import shutil
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mmengine.dist import all_reduce, is_main_process
from mmengine.optim import OptimWrapper
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ..agreement import control_group, fail_together
from ..dist import current_device
from ..names import checkpoint_keys, unwrapped_param_names
from ..optim import AnyOptimWrapper, named_optim_wrappers
from ..options import resolve_enum
from .background import BackgroundWrite, ShardStager, run_in_background, writer_group
from .durable import remove_stale_temporaries, replace_path, save_atomically, temporary_path
from .safe_io import SafeFileSystemReader, load_member, load_shards

__all__ = ['META_FILE', 'KeyMatch', 'StateDictType', 'check_shared_directory',
           'checkpoint_model_shapes', 'full_state_on_rank0', 'gather_full_state',
           'is_dcp_checkpoint', 'is_sharded_checkpoint', 'load_full_model_state',
           'load_full_optimizer_state', 'load_sharded', 'match_keys', 'model_shapes',
           'optimizer_extras', 'read_sharded_meta', 'resolve_state_dict_type', 'save_sharded',
           'save_sharded_in_background', 'sharded_state']

#: The file of a sharded checkpoint that holds everything but the shards.
META_FILE = 'mmengine.pth'
# Keys of an optimizer state that torch's optimizer owns; the rest (e.g. a loss
# scaler) belongs to mmengine's optim wrapper.
_OPTIMIZER_KEYS = ('state', 'param_groups')
# Top-level keys of the shards, as DCP flattens them into its metadata.
_MODEL, _OPTIMIZER = 'model.', 'optimizer.'


class StateDictType(enum.Enum):
    """What ``save_checkpoint(state_dict_type=...)`` writes."""

    #: One file, gathered on rank 0: loads anywhere, into anything.
    FULL = 'full'
    #: A directory with every rank's shard (``torch.distributed.checkpoint``).
    SHARDED = 'sharded'


def resolve_state_dict_type(value: Union[str, StateDictType]) -> StateDictType:
    """``state_dict_type``: ``'full'`` or ``'sharded'``."""
    return resolve_enum(value, StateDictType, 'state_dict_type',
                        {m.value: m for m in StateDictType})


def full_state_on_rank0(device: torch.device) -> bool:
    """Whether full state dicts gather to rank 0's CPU when training on ``device``.

    On an accelerator, yes: one full copy in host memory. The training device
    decides, not where (offloaded) parameters live. On the CPU, no: FSDP1's
    offload path crashes on CPU tensors (torch 2.13).
    """
    return device.type != 'cpu'


def _options(full: bool, strict: bool = True) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full,
                            cpu_offload=full and full_state_on_rank0(current_device()),
                            strict=strict)


def _model_state(model: nn.Module, options: StateDictOptions) -> Dict[str, Any]:
    """``get_model_state_dict``, keeping the keys the model's own ``state_dict()`` returns."""
    state = get_model_state_dict(model, options=options)
    keys = checkpoint_keys(model)
    return state if keys is None else {k: v for k, v in state.items() if k in keys}


def _per_wrapper(optim_wrapper: AnyOptimWrapper, fn) -> Any:
    """``fn(wrapper)`` for a single wrapper, ``{name: fn(wrapper)}`` for a dict of them."""
    results = {name: fn(wrapper) for name, wrapper in named_optim_wrappers(optim_wrapper)}
    return results[None] if None in results else results


def _select(tree: Any, name: Optional[str]) -> Any:
    """The part of a per-optim-wrapper tree that belongs to wrapper ``name``."""
    return tree if name is None else tree[name]


def optimizer_extras(optim_wrapper: AnyOptimWrapper) -> Any:
    """The optim wrapper's own state besides the optimizer's (e.g. ``loss_scaler``)."""
    return _per_wrapper(optim_wrapper, lambda w: {
        k: v for k, v in w.state_dict().items() if k not in _OPTIMIZER_KEYS})


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                     options: StateDictOptions) -> Dict[str, Any]:
    """``get_optimizer_state_dict``, without its side effect on an optimizer that has no state.

    DCP initialises an empty optimizer state by a zero-gradient ``step()``:
    Adam's ``step`` and moments would then exist, and training after a save
    made before the first real step would differ. That state is removed again
    where no rank has any: a rank may hold no element of any trainable
    parameter (FSDP1 with a frozen base model, an adapter's few tensors in one
    rank's part of a unit), and its part of a sharded state is still owed.
    Collective (one ``all_reduce``).
    """
    stepped = torch.tensor(int(bool(optimizer.state)))
    all_reduce(stepped, op='max')
    fresh = not stepped.item()
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if fresh:
        optimizer.state.clear()
        state = dict(state, state={})
    return state


def gather_full_state(model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper]
                      ) -> Tuple[Dict[str, torch.Tensor], Optional[Any]]:
    """The unsharded model state and name-keyed optimizer state (collective)."""
    options = _options(full=True)
    model_state = _model_state(model, options)
    if optim_wrapper is None:
        return model_state, None

    def wrapper_state(wrapper: OptimWrapper) -> Dict[str, Any]:
        state = {k: v for k, v in wrapper.state_dict().items() if k not in _OPTIMIZER_KEYS}
        state.update(_optimizer_state(model, wrapper.optimizer, options))
        return state

    return model_state, _per_wrapper(optim_wrapper, wrapper_state)


def sharded_state(model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper]
                  ) -> Tuple[Dict[str, Any], Optional[Any]]:
    """The model and optimizer shards of this rank, and the optimizer's param groups.

    The param groups (the same on every rank) are kept apart as plain values,
    so that no pickled object enters the shards. An optimizer without state
    has no shards.
    """
    options = _options(full=False)
    shards: Dict[str, Any] = dict(model=_model_state(model, options))
    if optim_wrapper is None:
        return shards, None
    states = {name: _optimizer_state(model, w.optimizer, options)
              for name, w in named_optim_wrappers(optim_wrapper)}
    tensors = {name: dict(state=s['state']) for name, s in states.items() if s['state']}
    groups = {name: s['param_groups'] for name, s in states.items()}
    if None in states:
        if tensors:
            shards['optimizer'] = tensors[None]
        return shards, groups[None]
    if tensors:
        shards['optimizer'] = tensors
    return shards, groups


def load_full_model_state(model: nn.Module, state: Dict[str, Any],
                          strict: bool) -> Tuple[List[str], List[str]]:
    """Load an unsharded state dict; returns the missing and unexpected keys."""
    with _buffers_beside_parameters(model):
        result = set_model_state_dict(model, state, options=_options(full=True, strict=strict))
    return list(result.missing_keys), list(result.unexpected_keys)


@contextlib.contextmanager
def _buffers_beside_parameters(model: nn.Module) -> Iterator[None]:
    """Within, the model's buffers are on its parameters' device (when that is one device).

    FSDP1's CPU offload keeps parameters on the CPU and buffers on the
    accelerator; torch 2.13's full ``set_model_state_dict`` raises "Multiple
    devices found" for that, though it only stages the values on that device.
    """
    devices = {p.device for p in model.parameters() if p.dim() > 0 and not p.is_meta}
    moved = []
    if len(devices) == 1:
        (device,) = devices
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.dim() > 0 and not buffer.is_meta and buffer.device != device:
                    moved.append((module, name, buffer.device))
                    setattr(module, name, buffer.to(device))
    try:
        yield
    finally:
        for module, name, original in moved:
            setattr(module, name, getattr(module, name).to(original))


def _named_optimizer_state(state: Dict[str, Any], optimizer: torch.optim.Optimizer,
                           model: nn.Module) -> Dict[str, Any]:
    """Convert torch's integer-keyed optimizer state (the stock Runner's) to parameter names.

    The integer ids match this optimizer's parameters in order, which holds
    when the optimizer is built by the same config.
    """
    groups = state['param_groups']
    _check_param_counts(groups, optimizer)
    if not groups or not groups[0]['params'] or isinstance(groups[0]['params'][0], str):
        return state
    names = unwrapped_param_names(model)
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g['params']]
    by_id = dict(zip((i for g in groups for i in g['params']), ordered))
    return dict(state={by_id[i]: s for i, s in state['state'].items()},
                param_groups=[dict(g, params=[by_id[i] for i in g['params']]) for g in groups])


def _check_param_counts(groups: List[Dict[str, Any]], optimizer: torch.optim.Optimizer) -> None:
    saved = [len(g['params']) for g in groups]
    own = [len(g['params']) for g in optimizer.param_groups]
    if saved != own:
        raise ValueError(
            f'the optimizer state in the checkpoint has param groups of {saved} parameters, '
            f'this optimizer has {own}: it was saved for another model or optim_wrapper '
            '(paramwise_cfg). Resume with the config that saved it, or set `resume = False` '
            'and use `load_from` to load the weights only.')


def _load_param_groups(optimizer: torch.optim.Optimizer, groups: List[Dict[str, Any]]) -> None:
    """Restore hyperparameters (lr, momentum, ...) of each param group; not the parameters."""
    _check_param_counts(groups, optimizer)
    for own, saved in zip(optimizer.param_groups, groups):
        own.update({k: v for k, v in saved.items() if k != 'params'})


def load_full_optimizer_state(model: nn.Module, optim_wrapper: AnyOptimWrapper,
                              state: Any) -> None:
    """Load a full optimizer state (name-keyed, or torch's integer-keyed format)."""
    for name, wrapper in named_optim_wrappers(optim_wrapper):
        own = _select(state, name)
        optimizer_state = _named_optimizer_state(
            {k: own[k] for k in _OPTIMIZER_KEYS}, wrapper.optimizer, model)
        # the hyperparameters first: DCP maps the saved groups' keys onto this optimizer's,
        # which lack those a scheduler adds (initial_lr) when resuming before train()
        _load_param_groups(wrapper.optimizer, optimizer_state['param_groups'])
        if optimizer_state['state']:  # else nothing to scatter; DCP would create state
            set_optimizer_state_dict(model, wrapper.optimizer, optimizer_state,
                                     options=_options(full=True))
        _load_optimizer_extras(wrapper, {k: v for k, v in own.items()
                                         if k not in _OPTIMIZER_KEYS})


def _load_optimizer_extras(wrapper: OptimWrapper, extras: Dict[str, Any]) -> None:
    if 'loss_scaler' in extras and hasattr(wrapper, 'loss_scaler'):
        wrapper.loss_scaler.load_state_dict(extras['loss_scaler'])
    # The base values that schedulers scale, present with several param groups.
    if extras.get('base_param_settings') is not None:
        wrapper.base_param_settings = extras['base_param_settings']


# ---- which checkpoint entries load into which model keys ---------------------------------


@dataclasses.dataclass
class KeyMatch:
    """The outcome of matching a checkpoint's keys with a model's."""

    #: model key -> checkpoint key, for every entry that loads.
    loaded: Dict[str, str]
    #: model keys that the checkpoint does not provide.
    missing: List[str]
    #: checkpoint keys (as saved) that the model does not have.
    unexpected: List[str]
    #: (model key, shape in the checkpoint, shape in the model) of skipped entries.
    mismatched: List[Tuple[str, torch.Size, torch.Size]]

    @property
    def exact(self) -> bool:
        """Whether every key matched with its shape."""
        return not (self.missing or self.unexpected or self.mismatched)

    def report(self) -> str:
        """What did not load, in mmengine's (and torch's) wording."""
        lines = ['The model and loaded state dict do not match exactly\n']
        lines += [f'size mismatch for {key}: copying a param with shape {saved} from checkpoint, '
                  f'the shape in current model is {own}.' for key, saved, own in self.mismatched]
        if self.unexpected:
            lines.append(f'unexpected key in source state_dict: {", ".join(self.unexpected)}\n')
        if self.missing:
            lines.append(f'missing keys in source state_dict: {", ".join(self.missing)}\n')
        return '\n'.join(lines)


def model_shapes(model: nn.Module) -> Dict[str, Optional[torch.Size]]:
    """The unwrapped model's keys and full shapes (``None``: not a tensor); collective."""
    state = _model_state(model, StateDictOptions(full_state_dict=False))
    return {k: torch.Size(v.size()) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


def match_keys(model: Mapping[str, Optional[torch.Size]],
               checkpoint: Mapping[str, Optional[torch.Size]],
               revise_keys: Sequence[Tuple[str, str]] = ()) -> KeyMatch:
    """Match checkpoint keys (renamed by ``revise_keys``) with model keys, by name and shape.

    >>> match_keys(model_shapes(model), {'head.weight': torch.Size([80, 16])}).mismatched
    [('head.weight', torch.Size([80, 16]), torch.Size([3, 16]))]
    """
    loaded, unexpected, mismatched = {}, [], []
    for saved_key, saved_shape in checkpoint.items():
        key = saved_key
        if key not in model:  # a key the model has is its own (a child may be called 'module')
            for pattern, replacement in revise_keys:
                key = re.sub(pattern, replacement, key)
        if key not in model:
            unexpected.append(saved_key)
        elif saved_shape is not None and model[key] is not None and saved_shape != model[key]:
            mismatched.append((key, saved_shape, model[key]))
        else:
            loaded[key] = saved_key
    skipped = {key for key, _, _ in mismatched}
    # mmengine does not report BatchNorm's counters as missing.
    missing = [k for k in model if k not in loaded and k not in skipped
               and 'num_batches_tracked' not in k]
    return KeyMatch(loaded, missing, unexpected, mismatched)


# ---- the sharded directory ---------------------------------------------------------------


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (it has a :data:`META_FILE`).

    Whatever that entry is: reading it (:func:`read_sharded_meta`) refuses
    anything but a regular file.
    """
    return os.path.lexists(os.path.join(path, META_FILE))


def is_dcp_checkpoint(path: str) -> bool:
    """Whether ``path`` is a DCP directory: mmfsdp's sharded checkpoint or ``dcp.save``'s."""
    return os.path.lexists(os.path.join(path, '.metadata'))


def read_sharded_meta(path: str, allow_unsafe: bool = False) -> Dict[str, Any]:
    """The non-shard part of a sharded checkpoint: meta, message hub, schedulers.

    ``{}`` for a directory torch's own ``dcp.save`` wrote (no :data:`META_FILE`).
    Read only as a regular file of the directory (:func:`~.safe_io.read_member`).
    """
    if not os.path.lexists(os.path.join(path, META_FILE)):
        return {}
    return load_member(path, META_FILE, allow_unsafe)


def _model_prefix(keys: Mapping[str, Any]) -> str:
    """Where a DCP checkpoint holds the model.

    Under ``model.`` (mmfsdp's, and ``dcp.save`` of ``{'model': ...}``), else
    under ``state_dict.`` (mmengine's name), else at the top level.
    """
    return next((p for p in (_MODEL, 'state_dict.') if any(k.startswith(p) for k in keys)), '')


def save_sharded(path: str, model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper],
                 extra: Dict[str, Any], wait_s: Optional[float] = None,
                 extra_shards: Optional[Dict[str, Any]] = None, token: str = '',
                 clean_tokens: Sequence[str] = ()) -> None:
    """Write every rank's shards and rank 0's ``extra`` to the directory ``path`` (collective).

    Written as ``<token>-NAME.tmp/`` and renamed once every rank is done, so a
    directory under the final name is complete. Rank 0's steps end in
    ``fail_together`` (``wait_s`` bounds the others' wait); ``extra_shards``
    are saved beside the model's (e.g. ``EMAHook``'s ``'ema'``); the
    temporaries of ``clean_tokens`` are removed after the rename.
    """
    tmp = _clear_temporary(path, token)
    shards, param_groups = _shards_to_write(model, optim_wrapper, extra_shards)
    with _single_process_is_intended():
        dcp.save(shards, checkpoint_id=tmp)
    with fail_together(f'saving checkpoint {path}', wait_s):
        if is_main_process():
            save_atomically(_with_param_groups(extra, param_groups),
                            os.path.join(tmp, META_FILE))
            replace_path(tmp, path, token)
            remove_stale_temporaries(os.path.dirname(os.path.abspath(path)), clean_tokens)


def save_sharded_in_background(path: str, model: nn.Module,
                               optim_wrapper: Optional[AnyOptimWrapper], extra: Dict[str, Any],
                               wait_s: float, extra_shards: Optional[Dict[str, Any]] = None,
                               token: str = '', clean_tokens: Sequence[str] = (),
                               stager: Optional[ShardStager] = None) -> BackgroundWrite:
    """:func:`save_sharded`, returning once the shards are staged (copied to this rank's CPU).

    DCP's ``save`` writes them to ``<token>-NAME.tmp/`` in a daemon thread
    (:func:`~.background.run_in_background`), coordinating on
    :func:`~.background.writer_group`; rank 0 then writes
    :data:`META_FILE`. Nothing is renamed: the caller publishes the returned
    write (:meth:`~.background.BackgroundWrite.publish`). ``stager`` (kept
    between saves) reuses its copies. Collective.
    """
    stager = stager or ShardStager()
    tmp = _clear_temporary(path, token)
    shards, param_groups = _shards_to_write(model, optim_wrapper, extra_shards)
    meta = copy.deepcopy(_with_param_groups(extra, param_groups)) if is_main_process() else None
    staged, group = stager.stage(shards), writer_group(wait_s)
    writer = _CoordinatedWriter(tmp)

    def write() -> None:
        with _single_process_is_intended():
            dcp.save(staged, storage_writer=writer, process_group=group)
        if meta is not None:  # last, after every rank's shards: it marks a complete directory
            save_atomically(meta, os.path.join(tmp, META_FILE))

    upload = run_in_background(write)
    stager.written_by(upload)
    return BackgroundWrite(path, tmp, token, clean_tokens, wait_s, upload, META_FILE)


class _CoordinatedWriter(dcp.FileSystemWriter):
    """DCP's ``FileSystemWriter`` that refuses to write a multi-rank checkpoint uncoordinated.

    ``dcp.save`` decides when it starts whether to coordinate the ranks:
    without a default process group it writes this rank's shards alone, under
    rank 0's file names and with a ``.metadata`` of its own, into the directory
    every rank shares. A background write can start after its group is gone
    (``dist.destroy_process_group()`` right after the save); then each rank
    fails here, before writing a shard: this rank's own number and every
    rank's plan are checked where DCP hands them over.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.expected = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized()
                         else (0, 1))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's set-up; refused if DCP numbers this rank as another (it saves alone)."""
        if kwargs.get('rank', self.expected[0]) != self.expected[0]:
            raise self._uncoordinated(f'rank {kwargs.get("rank")} of one')
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_global_plan(self, plans: List[Any]) -> List[Any]:
        """DCP's global plan (the coordinator); refused unless it holds every rank's plan."""
        if len(plans) != self.expected[1]:
            raise self._uncoordinated(f'{len(plans)} plan(s)')
        return super().prepare_global_plan(plans)

    def _uncoordinated(self, seen: str) -> RuntimeError:
        rank, world_size = self.expected
        return RuntimeError(
            f'the background write of {self.path} (rank {rank} of {world_size}) lost its process '
            f'group before DCP coordinated the ranks (DCP saw {seen}): '
            'dist.destroy_process_group() while it was written? Nothing is published. Publish '
            'first: runner.wait_for_checkpoint(), or mmfsdp.dist.shutdown_distributed(), which '
            'publishes a write in flight before it destroys the groups.')


def _clear_temporary(path: str, token: str) -> str:
    """Check that the ranks share ``path``'s directory; remove a leftover temporary; its name."""
    check_shared_directory(os.path.dirname(os.path.abspath(path)), token)
    tmp = temporary_path(path, token)
    with fail_together(f'clearing {tmp}'):
        if is_main_process() and os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return tmp


def _with_param_groups(extra: Dict[str, Any], param_groups: Any) -> Dict[str, Any]:
    return extra if param_groups is None else dict(extra, optimizer_param_groups=param_groups)


def _shards_to_write(model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper],
                     extra_shards: Optional[Dict[str, Any]]) -> Tuple[Dict[str, Any], Any]:
    """The shards this rank saves (``extra_shards`` beside its own), and the param groups.

    DCP writes an entry that several ranks hold once, by the rank with the
    smallest plan so far: the writes of parameters and optimizer state, equal
    on every rank that holds them (all under DDP, a shard's replicas in HSDP),
    are spread over the ranks. Entries of the model that are not parameters
    (BatchNorm's running statistics, EMAHook's averaged buffers beside them)
    differ across ranks; only rank 0 offers them, so that a sharded checkpoint
    holds rank 0's, as a full one does.
    """
    shards, param_groups = sharded_state(model, optim_wrapper)
    shards.update(extra_shards or {})
    if dist.is_initialized() and dist.get_rank() != 0:
        params = set(unwrapped_param_names(model).values())
        rank0s = {k for k, v in shards['model'].items() if k not in params and not _sharded(v)}
        shards = _without(shards, rank0s)
    return shards, param_groups


def _sharded(value: Any) -> bool:
    """Whether ``value`` is one rank's part of a tensor (``DTensor``, FSDP1's ``ShardedTensor``)."""
    return isinstance(value, DTensor) or callable(getattr(value, 'local_shards', None))


def _without(node: Any, keys: Set[str]) -> Any:
    """``node`` without the whole values it holds under ``keys``, at any depth."""
    if not isinstance(node, dict):
        return node
    return {k: _without(v, keys) for k, v in node.items()
            if k not in keys or isinstance(v, dict) or _sharded(v)}


# Directories that every rank of this process's job was seen to share.
_SHARED_DIRECTORIES: Set[str] = set()


def check_shared_directory(directory: str, token: str = '') -> None:
    """Refuse, on every rank and before anything is written, a directory the ranks do not share.

    On node-local disks the other nodes' shards would stay behind under the
    temporary name and a resume would fail later. Rank 0 writes a marker,
    every rank looks for it, one gather agrees. Collective; once per directory.
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


def checkpoint_model_shapes(path: str, allow_unsafe: bool = False
                            ) -> Dict[str, Optional[torch.Size]]:
    """The model keys and full shapes stored in a sharded checkpoint (reads only ``.metadata``)."""
    metadata = SafeFileSystemReader(path, allow_unsafe).read_metadata().state_dict_metadata
    prefix = _model_prefix(metadata)
    return {key[len(prefix):]: getattr(entry, 'size', None)
            for key, entry in metadata.items() if key.startswith(prefix)}


def load_sharded(path: str, model: nn.Module, optim_wrapper: Optional[AnyOptimWrapper] = None,
                 match: Optional[KeyMatch] = None, meta: Optional[Dict[str, Any]] = None,
                 allow_unsafe: bool = False) -> None:
    """Load the model (and the optimizer) from a sharded checkpoint, at any world size.

    ``match`` says which checkpoint entry goes into which model key (default:
    every key exactly); ``meta`` is the :data:`META_FILE` content, read if not given.
    """
    options = _options(full=False)
    own = _model_state(model, options)
    if match is None:
        match = match_keys({k: None for k in own}, {k: None for k in own})
    keys = SafeFileSystemReader(path, allow_unsafe).read_metadata().state_dict_metadata
    prefix = _model_prefix(keys)
    model_part = {saved: own[key] for key, saved in match.loaded.items()}
    template: Dict[str, Any] = {prefix[:-1]: model_part} if prefix else model_part
    wrappers = dict(named_optim_wrappers(optim_wrapper)) if optim_wrapper is not None else {}
    # An optimizer that had no state when saved has no shards.
    with_shards = [name for name in wrappers
                   if any(k.startswith(_OPTIMIZER if name is None else f'{_OPTIMIZER}{name}.')
                          for k in keys)]
    # An optimizer without state gets DCP's initial state (zeros) as the template.
    templates = {name: dict(state=get_optimizer_state_dict(
        model, wrappers[name].optimizer, options=options)['state']) for name in with_shards}
    if with_shards:
        template['optimizer'] = templates[None] if with_shards == [None] else templates
    with _single_process_is_intended():
        load_shards(template, path, allow_unsafe)
    model_part = template[prefix[:-1]] if prefix else template
    loaded = {key: model_part[saved] for key, saved in match.loaded.items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    if optim_wrapper is None:
        return
    meta = meta if meta is not None else read_sharded_meta(path, allow_unsafe)
    groups, extras = meta['optimizer_param_groups'], meta.get('optimizer_extras') or {}
    for name, wrapper in wrappers.items():
        own_groups = _select(groups, name)
        if name in with_shards:
            state = dict(state=_select(template['optimizer'], name)['state'],
                         param_groups=own_groups)
            _load_param_groups(wrapper.optimizer, own_groups)  # checks the parameter counts
            set_optimizer_state_dict(model, wrapper.optimizer, state, options=options)
        else:  # saved without optimizer state: DCP's template step must not leave any
            wrapper.optimizer.state.clear()
            _load_param_groups(wrapper.optimizer, own_groups)
        _load_optimizer_extras(wrapper, _select(extras, name) if extras else {})


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to load/save in a single process" warning.

    One-process use of a sharded checkpoint (``tools/test.py --launcher none``)
    is intended here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', category=UserWarning,
                                message='torch.distributed is disabled, unavailable or '
                                        'uninitialized, assuming the intent')
        yield
