"""``save_checkpoint`` / ``load_checkpoint`` / ``resume`` for :class:`mmfsdp.FSDPRunner`.

The stock versions save on rank 0 alone and load rank 0's view everywhere;
these take every rank through the gather or the scatter and keep the rest of
mmengine's behaviour (meta, message hub, schedulers, hooks).
"""
import dataclasses
import os
import os.path as osp
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mmengine
import torch
import torch.distributed as dist
from mmengine.dist import is_main_process

from ..agreement import control_group, fail_together
from ..compat import load_from, mark_checkpoint_loaded
from ..ema import EMAHook
from ..names import for_tta_model
from ..sync_norm import SyncNormHook
from .background import (
    BackgroundWrite,
    ShardStager,
    resolve_async_save,
    write_file_in_background,
)
from .durable import (
    find_complete_checkpoint,
    new_token,
    remove_stale_temporaries,
    save_atomically,
    temporary_path,
)
from .hook import DEFAULT_SAVE_TIMEOUT_S, CheckpointHook, resolve_save_timeout
from .safe_io import (
    UNSAFE_SWITCH,
    UnsafeCheckpointError,
    decode,
    encode,
    read_checkpoint,
    unsafe_values,
    without_code,
)
from .state import (
    META_FILE,
    KeyMatch,
    StateDictType,
    checkpoint_model_shapes,
    gather_full_state,
    is_dcp_checkpoint,
    is_sharded_checkpoint,
    load_full_model_state,
    load_full_optimizer_state,
    load_sharded,
    match_keys,
    model_shapes,
    optimizer_extras,
    read_sharded_meta,
    resolve_state_dict_type,
    save_sharded,
    save_sharded_in_background,
)

__all__ = ['CheckpointMixin', 'CheckpointState', 'DEFAULT_SAVE_TIMEOUT_S', 'TOKENS_KEY']

#: ``meta`` key of a checkpoint: the tokens of the runs whose temporaries the run that
#: wrote it removes; a run resuming from it takes them over.
TOKENS_KEY = 'temporary_tokens'

#: Stock hooks (by config type, or an mmengine / mmdet class by its name) that FSDPRunner
#: replaces with its own, same options; mmdet's is matched by name: mmdet need not be installed.
_REPLACED_HOOKS = {'CheckpointHook': CheckpointHook, 'EMAHook': EMAHook,
                   'SyncNormHook': SyncNormHook, 'mmdet.SyncNormHook': SyncNormHook}


@dataclasses.dataclass
class CheckpointState:
    """What a runner's saves and loads carry from one call to the next (one per runner)."""

    #: The save being written in the background, until it is published or settled.
    in_flight: Optional[BackgroundWrite] = None
    #: The copies of background saves, reused by the next one.
    stager: ShardStager = dataclasses.field(default_factory=ShardStager)
    #: This run's token in temporary names (rank 0 draws it at the first save).
    token: Optional[str] = None
    #: Tokens of the run resumed from, whose leftovers the next save removes.
    resumed_tokens: List[str] = dataclasses.field(default_factory=list)
    #: While :meth:`CheckpointMixin.resume` loads: whether it loads the optimizer state too.
    resuming: bool = False
    resume_optimizer: bool = False


class CheckpointMixin:
    """Checkpointing for a Runner whose model may be sharded.

    Example::

        default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1000,
                                             state_dict_type='sharded'))  # or 'full'
        load_from = 'work_dirs/exp/iter_1000.pth'  # full file, sharded directory, URL
        allow_unsafe_checkpoints = True  # only for files that pickle classes

    Hooks whose state is sharded like the model (:class:`mmfsdp.ema.EMAHook`)
    may implement two more hook points, called on every rank:
    ``collect_checkpoint_state(runner, checkpoint, shards=None)`` before rank
    0's ``before_save_checkpoint`` (``shards``: saved beside the model's), and
    ``after_load_checkpoint_shards(runner, path, checkpoint)``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.checkpoint_state = CheckpointState()
        super().__init__(*args, **kwargs)

    def register_hook(self, hook: Any, priority: Any = None) -> None:
        """Register a hook; stock ``CheckpointHook``, ``EMAHook``, ``SyncNormHook``: mmfsdp's."""
        if isinstance(hook, dict):
            kind = hook.get('type')
            if isinstance(kind, type) and kind.__module__.split('.')[0] in ('mmengine', 'mmdet'):
                kind = kind.__name__  # the class itself (a Python-style config)
            replacement = _REPLACED_HOOKS.get(kind)
            if replacement is not None:
                hook = dict(hook, type=replacement)
        super().register_hook(hook, priority)

    def save_checkpoint(self, out_dir: str, filename: str,
                        file_client_args: Optional[Dict] = None, save_optimizer: bool = True,
                        save_param_scheduler: bool = True, meta: Optional[Dict] = None,
                        by_epoch: bool = True, backend_args: Optional[Dict] = None,
                        state_dict_type: str = 'full',
                        save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
                        async_save: bool = False) -> None:
        """Save a checkpoint; every rank calls it (as ``CheckpointHook`` does).

        Args mirror ``Runner.save_checkpoint``, plus ``state_dict_type``
        (``'full'``: one file by rank 0; ``'sharded'``: a directory of every
        rank's shards), ``save_timeout`` (seconds the other ranks wait for
        rank 0's writes) and ``async_save`` (return once the state is staged;
        the checkpoint is written in the background and appears at the next
        save, :meth:`wait_for_checkpoint`, the end of ``train()`` or exit).
        A save still in flight is first waited for and published. Only local
        paths are supported.
        """
        kind = resolve_state_dict_type(state_dict_type)
        wait_s = resolve_save_timeout(save_timeout)
        background = resolve_async_save(async_save)
        if file_client_args is not None or backend_args is not None:
            raise ValueError('default_hooks.checkpoint: FSDPRunner writes checkpoints to local '
                             'paths only; remove file_client_args / backend_args')
        self.wait_for_checkpoint()
        path = osp.join(out_dir, filename)
        optim_wrapper = self.optim_wrapper if save_optimizer else None
        token, clean = self._temporaries()
        checkpoint: Dict[str, Any] = dict(meta=self._checkpoint_meta(meta, by_epoch),
                                          message_hub=self.message_hub.state_dict())
        checkpoint['meta'][TOKENS_KEY] = list(clean)
        if save_param_scheduler and self.param_schedulers is not None:
            checkpoint['param_schedulers'] = self._scheduler_states()
        if kind is StateDictType.FULL:
            checkpoint['state_dict'], optimizer = gather_full_state(self.model, optim_wrapper)
            if optimizer is not None:
                checkpoint['optimizer'] = optimizer
            # hooks with sharded state of their own (EMAHook) gather it, on every rank
            self.call_hook('collect_checkpoint_state', checkpoint=checkpoint)
            if background:
                self._start_background_write(checkpoint, path, token, clean, wait_s)
            else:
                with fail_together(f'saving checkpoint {path}', wait_s):
                    if is_main_process():
                        self.call_hook('before_save_checkpoint', checkpoint=checkpoint)
                        save_atomically(self._safe_to_load(checkpoint), path, token)
                        remove_stale_temporaries(out_dir, clean)
        else:
            if optim_wrapper is not None:
                checkpoint['optimizer_extras'] = optimizer_extras(optim_wrapper)
            extra_shards: Dict[str, Any] = {}
            self.call_hook('collect_checkpoint_state', checkpoint=checkpoint,
                           shards=extra_shards)
            with fail_together(f'before_save_checkpoint hooks for {path}'):
                if is_main_process():
                    self.call_hook('before_save_checkpoint', checkpoint=checkpoint)
                    checkpoint = self._safe_to_load(checkpoint)
            if background:
                self.checkpoint_state.in_flight = save_sharded_in_background(
                    path, self.model, optim_wrapper, checkpoint, wait_s, extra_shards, token,
                    clean, self.checkpoint_state.stager)
            else:
                save_sharded(path, self.model, optim_wrapper, checkpoint, wait_s, extra_shards,
                             token, clean)
        self.checkpoint_state.resumed_tokens = []  # their leftovers go with this one in place

    def _start_background_write(self, checkpoint: Dict[str, Any], path: str, token: str,
                                clean: Sequence[str], wait_s: float) -> None:
        """Rank 0 stages a full checkpoint (a private copy on its CPU) and writes it in a thread."""
        tmp = temporary_path(path, token)
        future = None
        with fail_together(f'staging checkpoint {path}', wait_s):
            if is_main_process():
                self.call_hook('before_save_checkpoint', checkpoint=checkpoint)
                staged = self.checkpoint_state.stager.copy(self._safe_to_load(checkpoint))
                os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
                future = write_file_in_background(staged, tmp)
                self.checkpoint_state.stager.written_by(future)
        self.checkpoint_state.in_flight = BackgroundWrite(path, tmp, token, clean, wait_s,
                                                          future)

    def checkpoint_in_flight(self) -> Optional[str]:
        """The path of the checkpoint being written in the background, or ``None``."""
        write = self.checkpoint_state.in_flight
        return write.path if write is not None else None

    def when_checkpoint_published(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on every rank) once the last saved checkpoint is in place.

        At once after a synchronous save; after an asynchronous one, when
        :meth:`wait_for_checkpoint` has published it. Not called if its write
        fails.
        """
        write = self.checkpoint_state.in_flight
        if write is None:
            callback()
        else:
            write.callbacks.append(callback)

    def wait_for_checkpoint(self) -> None:
        """Finish the checkpoint being written in the background, if any (collective).

        Every rank waits for its own write; the ranks agree that every write
        finished; rank 0 renames the checkpoint into place; then the hook
        repoints ``last_checkpoint`` and deletes what ``max_keep_ckpts``
        expires. A write that failed on any rank raises here on every rank,
        naming the rank and its error, and rank 0 removes its temporary.
        """
        write, self.checkpoint_state.in_flight = self.checkpoint_state.in_flight, None
        if write is not None:
            write.publish()

    def poll_checkpoint(self) -> None:
        """:meth:`wait_for_checkpoint` if the background write ended on every rank or failed.

        Never waits. Collective while a write is in flight (one ``all_reduce``
        of two integers), nothing otherwise; ``CheckpointHook`` calls it after
        every training iteration, so a failed write is an error on every rank
        within one iteration, and a finished one is published.
        """
        write = self.checkpoint_state.in_flight
        if write is not None and write.ended():
            self.wait_for_checkpoint()

    def settle_checkpoint(self) -> None:
        """After an error, finish the background write without the other ranks (no collective).

        Each rank waits for its own write (at most ``save_timeout``); rank 0
        publishes it if it completed on every rank, with ``last_checkpoint``,
        removes it if it failed, and logs which
        (:meth:`~.background.BackgroundWrite.settle`).
        """
        write, self.checkpoint_state.in_flight = self.checkpoint_state.in_flight, None
        if write is not None:
            write.settle()

    def load_checkpoint(self, filename: str, map_location: Any = 'cpu', strict: bool = False,
                        revise_keys: Sequence[Tuple[str, str]] = ((r'^module.', ''), )
                        ) -> Dict:
        """Load model weights from a full file, a sharded directory, an mmengine file or URI.

        mmengine's semantics: ``revise_keys`` renames keys; entries whose key or
        shape does not fit are skipped and listed in one warning on rank 0 (an
        error with ``strict=True``); a sharded directory of which no key fits is
        an error. ``map_location`` is ignored: files are read to the CPU.
        """
        allow_unsafe = bool(self.cfg.get(UNSAFE_SWITCH, False))
        sharded = is_sharded_checkpoint(filename) or is_dcp_checkpoint(filename)
        if sharded:
            checkpoint = read_sharded_meta(filename, allow_unsafe)  # {}: torch's dcp.save
            if not checkpoint and self.checkpoint_state.resuming:
                raise ValueError(
                    f'resume: {filename} is a DCP checkpoint without {META_FILE} (written by '
                    "torch's dcp.save): it holds weights, no iteration, optimizer or scheduler "
                    'state. Load its model entries with load_from and resume=False')
        else:
            checkpoint = read_checkpoint(filename, allow_unsafe)
            if not isinstance(checkpoint, dict):
                raise RuntimeError(f'No state_dict found in checkpoint file {filename}')
        checkpoint = decode(checkpoint)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        own = model_shapes(self.model)
        optim_wrapper = self._optim_wrapper_to_resume(checkpoint)
        if self.checkpoint_state.resuming:
            tokens = (checkpoint.get('meta') or {}).get(TOKENS_KEY) or []
            self.checkpoint_state.resumed_tokens = [t for t in tokens if isinstance(t, str)]
        if sharded:
            match = match_keys(own, checkpoint_model_shapes(filename, allow_unsafe), revise_keys)
            self._check_match(match, filename, strict, sharded=True)
            # model and optimizer in one pass
            load_sharded(filename, self.model, optim_wrapper, match=match, meta=checkpoint,
                         allow_unsafe=allow_unsafe)
            self.call_hook('after_load_checkpoint_shards', path=filename, checkpoint=checkpoint)
        else:
            state = checkpoint.get('state_dict', checkpoint)
            state = for_tta_model(state, set(own))  # mmengine loads a plain model into TTA
            match = match_keys(own, {k: torch.Size(v.shape) if isinstance(v, torch.Tensor)
                                     else None for k, v in state.items()}, revise_keys)
            self._check_match(match, filename, strict, sharded=False)
            load_full_model_state(self.model, {k: state[saved] for k, saved
                                               in match.loaded.items()}, strict=False)
            if optim_wrapper is not None:
                load_full_optimizer_state(self.model, optim_wrapper, checkpoint['optimizer'])
        mark_checkpoint_loaded(self)
        self.logger.info(f'Load checkpoint from {filename}' + (
            f' (a DCP checkpoint without {META_FILE}: its model entries)'
            if sharded and not checkpoint else ''))
        return checkpoint

    def _check_match(self, match: KeyMatch, filename: str, strict: bool, sharded: bool) -> None:
        """Raise (every rank) or warn (rank 0) about checkpoint entries that do not fit."""
        if sharded and not match.loaded:
            found = next(iter(match.unexpected), None)
            expected = next(iter(match.missing), None)
            raise ValueError(
                f'load_from={filename!r}: no key of this sharded checkpoint matches the model '
                f'(first expected key: {expected!r}, first found: {found!r}). Load a checkpoint '
                'of this model, or rename the keys with '
                'FSDPRunner.load_checkpoint(..., revise_keys=[(pattern, replacement)]).')
        if match.exact:
            return
        if strict:
            raise RuntimeError(f'{filename}: {match.report()}')
        if is_main_process():
            self.logger.warning(match.report())

    def resume(self, filename: str, resume_optimizer: bool = True,
               resume_param_scheduler: bool = True, map_location: Any = 'default') -> None:
        """Mmengine's ``resume``, with the optimizer state loaded at any world size.

        Auto-resume (``resume=True`` without ``load_from``) skips an incomplete
        latest checkpoint for the newest complete one before it, with a warning.
        """
        if load_from(self) is None:
            filename = self._complete_checkpoint(filename)
        state = self.checkpoint_state
        state.resuming, state.resume_optimizer = True, resume_optimizer
        try:  # load_checkpoint loads the optimizer state too
            super().resume(filename, resume_optimizer=False,
                           resume_param_scheduler=resume_param_scheduler, map_location='cpu')
        finally:
            state.resuming = False

    def _optim_wrapper_to_resume(self, checkpoint: Dict[str, Any]) -> Any:
        """The optim wrapper whose state a resume loads from ``checkpoint``, or ``None``.

        As the stock ``Runner.resume``, it is built from its config if need be
        (a resume before ``train()``) and loaded before the parameter schedulers
        are built: their first step scales the resumed learning rates.
        """
        if not (self.checkpoint_state.resuming and self.checkpoint_state.resume_optimizer):
            return None
        if 'optimizer' not in checkpoint and 'optimizer_param_groups' not in checkpoint:
            return None
        self.optim_wrapper = self.build_optim_wrapper(self.optim_wrapper)
        return self.optim_wrapper

    def _safe_to_load(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """``checkpoint`` encoded for ``weights_only`` loading; warn about what cannot be."""
        checkpoint = encode(checkpoint)
        for where, kind in unsafe_values(checkpoint):
            self.logger.warning(
                f'{where} is a {kind.__module__}.{kind.__qualname__}, which '
                'torch.load(weights_only=True) refuses: this checkpoint will load only with '
                f'`{UNSAFE_SWITCH} = True`. Store plain values or tensors there instead.')
        return checkpoint

    def _temporaries(self) -> Tuple[str, List[str]]:
        """The run's token for temporary names, and the tokens whose leftovers it removes.

        Rank 0 draws the token at the first save and shares it. A run also
        removes the leftovers of the run it resumed from (:data:`TOKENS_KEY`),
        as the stock ``CheckpointHook`` takes over ``keep_ckpt_ids``.
        """
        state = self.checkpoint_state
        if state.token is None:
            state.token = _from_rank0(new_token())
        return state.token, [state.token] + [t for t in state.resumed_tokens if t != state.token]

    def checkpoint_lineage(self, path: str) -> List[str]:
        """The tokens of the runs whose temporaries may continue the checkpoint at ``path``.

        Its ``meta['temporary_tokens']`` (:data:`TOKENS_KEY`): the run that
        wrote it and the runs that one resumed from. ``[]`` if it cannot be read.
        """
        allow_unsafe = bool(self.cfg.get(UNSAFE_SWITCH, False))
        try:
            checkpoint = (read_sharded_meta(path, allow_unsafe) if is_sharded_checkpoint(path)
                          else read_checkpoint(path, allow_unsafe))
        except UnsafeCheckpointError:
            raise  # the user must hear it (the resume would refuse it too)
        except Exception:  # noqa: BLE001 - missing or cut: no lineage to continue
            return []
        meta = checkpoint.get('meta') if isinstance(checkpoint, dict) else None
        tokens = (meta or {}).get(TOKENS_KEY) or []
        return [t for t in tokens if isinstance(t, str)]

    def _complete_checkpoint(self, filename: str) -> str:
        """Rank 0 picks the checkpoint to auto-resume from; every rank gets its choice."""
        with fail_together('choosing the checkpoint to resume from'):
            chosen = (find_complete_checkpoint(filename, META_FILE, self.logger.warning,
                                               bool(self.cfg.get(UNSAFE_SWITCH, False)))
                      if is_main_process() else None)
        return _from_rank0(chosen)

    def _checkpoint_meta(self, meta: Optional[Dict], by_epoch: bool) -> Dict[str, Any]:
        """The ``meta`` entry of the stock Runner's checkpoints."""
        meta = dict(meta or {})
        meta.setdefault('epoch', self.epoch + 1 if by_epoch else self.epoch)
        meta.setdefault('iter', self.iter if by_epoch else self.iter + 1)
        meta.update(cfg=self.cfg.pretty_text, seed=self.seed,
                    experiment_name=self.experiment_name,
                    time=time.strftime('%Y%m%d_%H%M%S', time.localtime()),
                    mmengine_version=mmengine.__version__)
        dataset = getattr(self.train_dataloader, 'dataset', None)
        if hasattr(dataset, 'metainfo'):
            meta['dataset_meta'] = dataset.metainfo
        return meta

    def _scheduler_states(self) -> Any:
        if isinstance(self.param_schedulers, dict):
            return {name: [without_code(s.state_dict()) for s in schedulers]
                    for name, schedulers in self.param_schedulers.items()}
        return [without_code(s.state_dict()) for s in self.param_schedulers]


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]
