"""``CheckpointHook`` that never deletes the last good checkpoint before the next exists.

mmengine's hook removes the oldest checkpoint (``max_keep_ckpts``) *before*
saving the new one, so a crash during that save can leave no checkpoint at
all. This subclass saves first, then points ``last_checkpoint`` at the new
checkpoint (atomically), and only then removes the expired one; a checkpoint
that a crash at that point left behind is still listed in the saved
``keep_ckpt_ids``, so the resumed run removes it as the stock hook removes any
id beyond ``max_keep_ckpts``. Every option of
the stock hook keeps its meaning; ``FSDPRunner`` uses it wherever a config asks
for ``CheckpointHook``. ``save_best`` honours ``state_dict_type`` and also
writes the new best before deleting the old one; ``published_keys`` works on
sharded checkpoints too (:mod:`.publish`).
"""
import logging
import os
import shutil
from typing import Tuple

from mmengine.dist import is_main_process
from mmengine.logging import MMLogger

from ..compat import CheckpointHookSteps
from ..registry import HOOKS
from ..together import fail_together
from .durable import write_text_atomically
from .publish import publish

__all__ = ['CheckpointHook']


@HOOKS.register_module()
class CheckpointHook(CheckpointHookSteps):
    """mmengine's ``CheckpointHook``, crash-safe: save, then repoint, then delete."""

    def before_train(self, runner) -> None:
        """The stock set-up, without two notices about mmengine's own code.

        mmengine's hook builds a ``FileClient`` for backward compatibility even
        when ``file_client_args`` is unset, and does not use it then; building it
        logs that ``FileClient`` and ``HardDiskBackend`` are deprecated on every
        run. Those two log records are dropped here; all others pass.
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

    def save_checkpoint_with_step(self, runner, step, meta) -> None:
        """The stock bookkeeping and save, then repoint, then delete the expired checkpoint.

        Until it is deleted, the expired checkpoint stays first in the
        ``keep_ckpt_ids`` that the new checkpoint's message hub holds: after a
        crash in between, the resumed run's stock ``before_train`` finds more
        ids than ``max_keep_ckpts`` and deletes the oldest, as mmengine does.
        Nothing that this run (or the run it resumed) did not write is deleted.
        """
        expired = None
        if self.max_keep_ckpts > 0 and not (self.kept_steps and self.kept_steps[-1] == step):
            kept = self.kept_steps
            if len(kept) == self.max_keep_ckpts:
                expired = kept.popleft()
            kept.append(step)
            pending = ([expired] if expired is not None else []) + list(kept)
            runner.message_hub.update_info('keep_ckpt_ids', pending)

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
        pointer = os.path.join(runner.work_dir, 'last_checkpoint')
        with fail_together(f'updating {pointer} after saving {filename}'):
            if is_main_process():
                write_text_atomically(self.last_ckpt, pointer)
                if expired is not None:
                    _remove(self.checkpoint_path(self.checkpoint_name(expired)))
        if expired is not None:
            runner.message_hub.update_info('keep_ckpt_ids', list(self.kept_steps))

    def save_best_checkpoint(self, runner, metrics) -> None:
        """The stock ``save_best``, saved like every other checkpoint, new before old.

        The stock hook saves the best checkpoint without the hook's extra
        arguments (so always ``state_dict_type='full'``) and deletes the
        previous best before writing the new one. Here ``state_dict_type`` and
        the other ``**args`` apply, and the previous best is removed only once
        the new one is complete.
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
            with fail_together(f'removing the previous best checkpoint {previous}'):
                if is_main_process() and previous and previous != path:
                    _remove(previous)
                    runner.logger.info(f'The previous best checkpoint {previous} is removed')
            runner.logger.info(f'The best checkpoint with {score:0.4f} {indicator} at {step} '
                               f'{unit} is saved to {name}.')
        # As mmengine: save the regular checkpoint again, so that the message hub
        # it holds names the current best (resuming must be able to remove it).
        if updated and self.last_ckpt is not None:
            self.save_checkpoint_with_step(runner, step, meta)

    def publish_model(self, runner, ckpt_path: str) -> None:
        """Publish a full file or a sharded directory (:func:`~.publish.publish`)."""
        with fail_together(f'publishing {ckpt_path}'):
            if is_main_process():
                published = publish(ckpt_path, self.published_keys)
                if published['removed']:
                    runner.logger.info(
                        f'Keys {published["removed"]} are left out of the published checkpoint: '
                        'they are not in published_keys')
                runner.logger.info(f'The checkpoint ({ckpt_path}) is published to '
                                   f'{published["path"]}.')


class _DropRecords(logging.Filter):
    """Drops the log records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: Tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
