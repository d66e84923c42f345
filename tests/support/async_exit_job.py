"""A job that ends with background saves in flight: ``torchrun ... async_exit_job.py``.

Arguments: WORK_DIR MODE. ``outside``: two runners train 2 iterations, then
each saves outside ``train()`` with ``async_save=True`` (``full.pth``, then
the sharded ``sharded.pth``), is dropped and garbage-collected, and the job
exits normally. ``stuck``: rank 0's background write of ``stuck.pth`` never
returns (a hung file system); ``save_timeout=3`` expires, every rank raises,
prints its error, and the job exits (code 0).
"""
import gc
import os
import sys
import threading
import weakref

import torch
from mmengine.config import Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mmfsdp import FSDPRunner  # noqa: E402
from toy import FSDP2, runner_config  # noqa: E402


def _trained(work_dir: str) -> FSDPRunner:
    runner = FSDPRunner.from_cfg(Config(runner_config(
        'exit', work_dir, wrapper=FSDP2, batch_size=4, max_iters=2)))
    runner.train()
    return runner


def main(work_dir: str, mode: str) -> None:
    if mode == 'outside':
        dropped = []
        for kind in ('full', 'sharded'):
            runner = _trained(work_dir)
            runner.save_checkpoint(work_dir, f'{kind}.pth', async_save=True,
                                   state_dict_type=kind)
            dropped.append(weakref.ref(runner))
            del runner
        gc.collect()
        print('runners collected:', [ref() is None for ref in dropped], flush=True)
        return
    runner = _trained(work_dir)
    if runner.rank == 0:
        real_save = torch.save

        def save(obj, f, *args, **kwargs):  # the writer thread hangs on the file system
            if str(getattr(f, 'name', f)).endswith('stuck.pth.tmp'):
                threading.Event().wait()
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    runner.save_checkpoint(work_dir, 'stuck.pth', async_save=True, save_timeout=3)
    try:
        runner.wait_for_checkpoint()
    except Exception as e:  # noqa: BLE001 - printed for the test
        print(f'rank {runner.rank} raised {type(e).__name__}: {e}', flush=True)


if __name__ == '__main__':
    main(*sys.argv[1:])
