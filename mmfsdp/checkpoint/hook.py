"""``CheckpointHook`` that never deletes the last good checkpoint before the next exists.

mmengine's hook removes the checkpoint ``max_keep_ckpts`` expires *before*
saving the new one, so a crash during that save can leave none. This one
saves, points ``last_checkpoint`` at the new checkpoint, then deletes. Every
stock option keeps its meaning; ``FSDPRunner`` uses it wherever a config asks
for ``CheckpointHook``::

    default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1000,
                                         max_keep_ckpts=3, state_dict_type='sharded',
                                         async_save=True,
                                         published_keys=['meta', 'state_dict']))

With ``async_save=True`` a checkpoint is written in the background
(:mod:`.background`): it is renamed into place, ``last_checkpoint`` repointed
and the expired one deleted when the write is published, once every rank's
write has finished (checked after each training iteration).
"""
import hashlib
import logging
import os
import tempfile
from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

from mmengine.dist import is_main_process
from mmengine.logging import MMLogger

from ..agreement import fail_together
from ..compat import CheckpointHookSteps
from ..options import check_keys
from ..registry import HOOKS
from .background import resolve_async_save
from .durable import remove_path, replace_path, save_atomically, write_text_atomically
from .safe_io import ENCODING_KEY, UNSAFE_SWITCH, load_file
from .state import is_sharded_checkpoint, resolve_state_dict_type

__all__ = ['CheckpointHook', 'DEFAULT_SAVE_TIMEOUT_S', 'EXPIRED_KEY', 'SAVE_OPTIONS',
           'check_save_options', 'publish', 'resolve_save_timeout']

#: How long the other ranks wait for rank 0 to write a checkpoint, by default: generous,
#: as it bounds only a slow but live save (a failing rank fails the others at once); the
#: process group's timeout is sized for collectives and would kill a healthy multi-GB save.
DEFAULT_SAVE_TIMEOUT_S = 3600.0
#: Message hub key: the step whose checkpoint ``max_keep_ckpts`` expired, until it is deleted.
EXPIRED_KEY = 'expired_ckpt_ids'


def resolve_save_timeout(value: Any) -> float:
    """``save_timeout``: positive seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TypeError(f'default_hooks.checkpoint.save_timeout: expected positive seconds, '
                        f'got {value!r}')
    return float(value)


#: The options ``FSDPRunner.save_checkpoint`` takes beyond the stock hook's, and their resolvers.
SAVE_OPTIONS: Dict[str, Callable[[Any], Any]] = {
    'state_dict_type': resolve_state_dict_type,
    'save_timeout': resolve_save_timeout,
    'async_save': resolve_async_save,
}


def check_save_options(options: Mapping[str, Any]) -> None:
    """Refuse an unknown key or a bad value among the hook's extra options, naming it."""
    check_keys(options, SAVE_OPTIONS, 'default_hooks.checkpoint')
    for key, value in options.items():
        SAVE_OPTIONS[key](value)


def _when_published(runner: Any, callback: Callable[[], None]) -> None:
    """``callback`` once the checkpoint just saved is in place (at once if saved synchronously)."""
    later = getattr(runner, 'when_checkpoint_published', None)
    if later is None:
        callback()
    else:
        later(callback)


def _wait_for_checkpoint(runner: Any) -> None:
    """Publish a checkpoint still being written in the background (collective)."""
    wait = getattr(runner, 'wait_for_checkpoint', None)
    if wait is not None:
        wait()


@HOOKS.register_module()
class CheckpointHook(CheckpointHookSteps):
    """mmengine's ``CheckpointHook``, crash-safe: save, then repoint, then delete.

    ``FSDPRunner`` runs a config's stock ``CheckpointHook`` as this one. Every
    rank takes part in a save; ``state_dict_type`` picks one gathered file or a
    sharded directory; the checkpoint ``max_keep_ckpts`` expires is deleted
    only once the new one is complete and ``last_checkpoint`` points at it.

    Config::

        default_hooks = dict(checkpoint=dict(
            type='CheckpointHook', interval=1000, max_keep_ckpts=3,
            state_dict_type='sharded', async_save=False, save_timeout=3600))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The stock options; the extra ones are checked here, at start-up, on every rank.

        The extra ones (:data:`SAVE_OPTIONS`): ``state_dict_type``,
        ``save_timeout`` and ``async_save``.
        """
        super().__init__(*args, **kwargs)
        check_save_options(self.save_kwargs)

    def before_train(self, runner) -> None:
        """The stock set-up, then delete the checkpoint a resumed run had expired, if still there.

        (A crash between a save and the deletion it allows leaves it.)
        """
        self._stock_before_train(runner)
        expired = runner.message_hub.runtime_info.get(EXPIRED_KEY)
        if self.max_keep_ckpts > 0 and expired:
            self._remove_expired(runner, expired)

    def _stock_before_train(self, runner) -> None:
        """The stock ``before_train``, without two deprecation notices about mmengine's own code.

        mmengine builds an unused ``FileClient`` even when ``file_client_args``
        is unset, which logs that ``FileClient`` and ``HardDiskBackend`` are
        deprecated on every run.
        """
        if self.file_client_args is not None:
            super().before_train(runner)
            return
        notices = _DropRecords(('"FileClient" will be deprecated',
                                '"HardDiskBackend" is the alias of "LocalBackend"'))
        logger = MMLogger.get_current_instance()
        logger.addFilter(notices)
        try:
            super().before_train(runner)
        finally:
            logger.removeFilter(notices)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        """Publish a background write that ended, or raise its error (every rank); then save."""
        poll = getattr(runner, 'poll_checkpoint', None)
        if poll is not None:
            poll()
        super().after_train_iter(runner, batch_idx, data_batch, outputs)

    def save_checkpoint_with_step(self, runner, step, meta) -> None:
        """The stock bookkeeping and save, then repoint, then delete the expired checkpoint.

        ``keep_ckpt_ids`` is the stock list; until deleted, the expired
        checkpoint is recorded apart (:data:`EXPIRED_KEY`), so that after a
        crash in between the resumed run deletes it (:meth:`before_train`).
        After an asynchronous save, repointing and deleting wait until the
        checkpoint is published; a save still in flight is published first,
        so that the bookkeeping sees what a synchronous run would.
        """
        _wait_for_checkpoint(runner)
        expired = None
        if self.max_keep_ckpts > 0 and not (self.kept_steps and self.kept_steps[-1] == step):
            kept = self.kept_steps
            if len(kept) == self.max_keep_ckpts:
                expired = kept.popleft()
                runner.message_hub.update_info(EXPIRED_KEY, [expired])
            kept.append(step)
            runner.message_hub.update_info('keep_ckpt_ids', list(kept))

        filename = self.checkpoint_name(step)
        self.last_ckpt = self.checkpoint_path(filename)
        runner.message_hub.update_info('last_ckpt', self.last_ckpt)
        runner.save_checkpoint(
            self.out_dir,
            filename,
            self.file_client_args,
            save_optimizer=self.save_optimizer,
            save_param_scheduler=self.save_param_scheduler,
            meta=meta,
            by_epoch=self.by_epoch,
            backend_args=self.backend_args,
            **self.save_kwargs)
        saved = self.last_ckpt
        _when_published(runner, lambda: self._repoint(runner, saved, expired))

    def _repoint(self, runner, path: str, expired) -> None:
        """Point ``last_checkpoint`` at ``path``, then delete the ``expired`` step's checkpoint."""
        pointer = os.path.join(runner.work_dir, 'last_checkpoint')
        with fail_together(f'updating {pointer} after saving {os.path.basename(path)}'):
            if is_main_process():
                write_text_atomically(path, pointer)
        if expired is not None:
            self._remove_expired(runner, [expired])

    def _remove_expired(self, runner, steps: Sequence[int]) -> None:
        """Delete the checkpoints of ``steps`` that ``max_keep_ckpts`` expired, and forget them."""
        with fail_together(f'removing the expired checkpoints of steps {list(steps)}'):
            if is_main_process():
                for step in steps:
                    remove_path(self.checkpoint_path(self.checkpoint_name(step)))
        runner.message_hub.pop_info(EXPIRED_KEY, None)

    def save_best_checkpoint(self, runner, metrics) -> None:
        """The stock ``save_best``, but with the hook's ``state_dict_type`` and new before old.

        (The stock hook always saves the best as a full file, and deletes the
        previous best before writing the new one.)
        """
        if not self.save_best:
            return
        step, unit = (runner.epoch, 'epoch') if self.by_epoch else (runner.iter, 'iter')
        meta = dict(epoch=runner.epoch, iter=runner.iter)
        if 'auto' in self.key_indicators:
            self.init_rule(self.rules, [next(iter(metrics))])
        single = len(self.key_indicators) == 1
        updated = False
        for indicator, rule in zip(self.key_indicators, self.rules):
            score_key = 'best_score' if single else f'best_score_{indicator}'
            score, best = metrics[indicator], runner.message_hub.get_info(
                score_key, self.init_value_map[rule])
            if score is None or not self.is_better_than[indicator](score, best):
                continue
            updated = True
            runner.message_hub.update_info(score_key, score)
            previous = self.best_ckpt_path if single else self.best_ckpt_path_dict[indicator]
            name = f'best_{indicator}_{self.checkpoint_name(step)}'.replace('/', '_')
            path = self.checkpoint_path(name)
            if single:
                self.best_ckpt_path = path
            else:
                self.best_ckpt_path_dict[indicator] = path
            runner.message_hub.update_info('best_ckpt' if single else f'best_ckpt_{indicator}',
                                           path)
            runner.save_checkpoint(self.out_dir, filename=name,
                                   file_client_args=self.file_client_args, save_optimizer=False,
                                   save_param_scheduler=False, meta=meta, by_epoch=False,
                                   backend_args=self.backend_args, **self.save_kwargs)
            _when_published(runner, lambda old=previous, new=path: self._remove_best(
                runner, old, new))
            runner.logger.info(f'The best checkpoint with {score:0.4f} {indicator} at {step} '
                               f'{unit} is saved to {name}.')
        # As mmengine: save the regular checkpoint again, so that the message hub
        # it holds names the current best (resuming must be able to remove it).
        if updated and self.last_ckpt is not None:
            self.save_checkpoint_with_step(runner, step, meta)

    @staticmethod
    def _remove_best(runner, previous: str, path: str) -> None:
        with fail_together(f'removing the previous best checkpoint {previous}'):
            if is_main_process() and previous and previous != path:
                remove_path(previous)
                runner.logger.info(f'The previous best checkpoint {previous} is removed')

    def after_train(self, runner) -> None:
        """Publish a checkpoint still being written in the background, then as the stock hook."""
        _wait_for_checkpoint(runner)
        super().after_train(runner)

    def publish_model(self, runner, ckpt_path: str) -> None:
        """Publish a full file or a sharded directory (:func:`publish`)."""
        _wait_for_checkpoint(runner)
        with fail_together(f'publishing {ckpt_path}'):
            if is_main_process():
                published = publish(ckpt_path, self.published_keys,
                                    bool(runner.cfg.get(UNSAFE_SWITCH, False)))
                if published['removed']:
                    runner.logger.info(
                        f'Keys {published["removed"]} are left out of the published checkpoint: '
                        'they are not in published_keys')
                runner.logger.info(f'The checkpoint ({ckpt_path}) is published to '
                                   f'{published["path"]}.')


def publish(path: str, published_keys: Sequence[str],
            allow_unsafe: bool = False) -> Dict[str, Any]:
    """Write ``<path without .pth>-<sha256[:8]>.pth`` with the ``published_keys`` of ``path``.

    ``path`` is a full file or a sharded directory (consolidated first, in one
    process), read as the run reads its checkpoints: ``allow_unsafe`` is the
    config's ``allow_unsafe_checkpoints``. The name carries the hash as
    ``torch.hub``'s ``check_hash`` expects. Returns ``dict(path=..., removed=[keys left out])``.
    """
    from ..consolidate import consolidate  # consolidate imports this package
    if is_sharded_checkpoint(path):
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path))) as tmp:
            checkpoint = consolidate(path, os.path.join(tmp, 'full.pth'), allow_unsafe)
    else:
        checkpoint = load_file(path, allow_unsafe)
    record = checkpoint.pop(ENCODING_KEY, {})
    removed = [k for k in checkpoint if k not in published_keys]
    checkpoint = {k: v for k, v in checkpoint.items() if k in published_keys}
    record = {k: v for k, v in record.items() if k in published_keys}
    if record:  # how the published entries' numpy values come back
        checkpoint[ENCODING_KEY] = record
    base = os.path.splitext(path.rstrip(os.sep))[0]
    tmp = f'{base}-publishing.pth'
    save_atomically(checkpoint, tmp)
    digest = hashlib.sha256()
    with open(tmp, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    final = f'{base}-{digest.hexdigest()[:8]}.pth'
    replace_path(tmp, final)
    return dict(path=final, removed=removed)


class _DropRecords(logging.Filter):
    """Drops the log records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: Tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)
