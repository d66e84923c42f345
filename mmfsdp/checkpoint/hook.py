"""``CheckpointHook`` that never deletes the last good checkpoint before the next exists.

mmengine's hook removes the oldest checkpoint (``max_keep_ckpts``) *before*
saving the new one, so a crash during that save can leave no checkpoint at
all. This subclass saves first, then points ``last_checkpoint`` at the new
checkpoint (atomically), and only then removes the expired one. Every option of
the stock hook keeps its meaning; ``FSDPRunner`` uses it wherever a config asks
for ``CheckpointHook``.
"""
import os
import shutil

from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook as MMEngineCheckpointHook

from ..registry import HOOKS

__all__ = ['CheckpointHook']


@HOOKS.register_module()
class CheckpointHook(MMEngineCheckpointHook):
    """mmengine's ``CheckpointHook``, crash-safe: save, then repoint, then delete."""

    def _save_checkpoint_with_step(self, runner, step, meta) -> None:
        expired = None
        if self.max_keep_ckpts > 0 and not (self.keep_ckpt_ids
                                            and self.keep_ckpt_ids[-1] == step):
            if len(self.keep_ckpt_ids) == self.max_keep_ckpts:
                expired = self.keep_ckpt_ids.popleft()
            self.keep_ckpt_ids.append(step)
            runner.message_hub.update_info('keep_ckpt_ids', list(self.keep_ckpt_ids))

        filename = self.filename_tmpl.format(step)
        self.last_ckpt = self.file_backend.join_path(self.out_dir, filename)
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
            **self.args)
        if not is_main_process():
            return
        pointer = os.path.join(runner.work_dir, 'last_checkpoint')
        with open(f'{pointer}.tmp', 'w') as f:
            f.write(self.last_ckpt)
        os.replace(f'{pointer}.tmp', pointer)
        if expired is not None:
            path = self.file_backend.join_path(self.out_dir, self.filename_tmpl.format(expired))
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.isfile(path):
                os.remove(path)
