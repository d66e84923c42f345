"""A training job for torchrun: ``python -m torch.distributed.run ... elastic_job.py``.

Arguments: WORK_DIR OUT KILL_AT [MODE]. With KILL_AT > 0, on the first attempt,
rank 1 SIGKILLs itself after iteration KILL_AT (MODE ``step``, the default), or
rank 0 while writing the checkpoint of iteration KILL_AT, half of it on disk
(MODE ``save``); torchrun (``--max-restarts``) then restarts every worker, and
``resume=True`` continues from the last complete checkpoint. Rank 0 saves the
final model state to OUT.
"""
import os
import signal
import sys

import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mmfsdp  # noqa: E402, F401
from toy import runner_config  # noqa: E402


@HOOKS.register_module()
class KillOnceHook(Hook):
    """SIGKILL rank 1 after iteration ``at`` on torchrun's first attempt."""

    def __init__(self, at: int) -> None:
        self.at = at

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        first_attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
        if first_attempt and runner.rank == 1 and runner.iter + 1 == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def _kill_rank0_mid_save(kill_at: int) -> None:
    """Rank 0 of the first attempt dies with half of ``iter_<kill_at>.pth`` written."""
    first_attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
    if not first_attempt or os.environ['RANK'] != '0':
        return
    real_save, target = torch.save, f'iter_{kill_at}.pth.tmp'

    def save(obj, f, *args, **kwargs):
        if str(f).endswith(target):
            with open(f, 'wb') as partial:
                partial.write(b'PK\x03\x04 half a checkpoint')
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def main() -> None:
    work_dir, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else 'step'
    torch.set_num_threads(1)
    cfg = runner_config('elastic', work_dir, batch_size=4, max_iters=6,
                        wrapper=dict(type='mmfsdp.MMFullyShardedDataParallel',
                                     auto_wrap_policy=dict(type='transformer',
                                                           layer_cls=['ToyBlock'])))
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2, by_epoch=False)
    cfg.update(resume=True, env_cfg=dict(dist_cfg=dict(timeout=20)))
    if kill_at and mode == 'step':
        cfg['custom_hooks'] = [dict(type='KillOnceHook', at=kill_at)]
    elif kill_at:
        _kill_rank0_mid_save(kill_at)
    runner = mmfsdp.FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    from mmfsdp.checkpoint.state import gather_full_state
    state, _ = gather_full_state(runner.model, None)
    if runner.rank == 0:
        torch.save(dict(state=state, iter=runner.iter,
                        restarts=int(os.environ.get('TORCHELASTIC_RESTART_COUNT', 0))), out)


if __name__ == '__main__':
    main()
