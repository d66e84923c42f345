"""A job of tests/jobs/test_cross_torch_checkpoints.py, run by the interpreter of one torch.

``torchrun --nproc-per-node 2 cross_torch_job.py save DIR``: 2 ranks train the toy
classifier under FSDP2 for two iterations and save a sharded checkpoint
``DIR/iter_2.pth``; ``load DIR`` resumes from it (nothing left to train). Rank 0 prints
one JSON line: the torch version, the iteration and the full model state as lists.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from toy import runner_config  # noqa: E402

BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])


def _run(mode: str, work_dir: str) -> dict:
    import torch
    from mmengine.config import Config
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from mmfsdp import FSDPRunner
    cfg = runner_config(f'cross-torch-{mode}', work_dir, batch_size=4, max_iters=2,
                        wrapper=dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=BLOCKS))
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=2, by_epoch=False,
                                              state_dict_type='sharded')
    if mode == 'load':
        cfg.update(load_from=os.path.join(work_dir, 'iter_2.pth'), resume=True)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    state = get_model_state_dict(runner.model, options=StateDictOptions(full_state_dict=True))
    return dict(torch=str(torch.__version__), iter=runner.iter,
                model={k: v.float().flatten().tolist() for k, v in state.items()})


if __name__ == '__main__':
    from mmfsdp.dist import shutdown_distributed
    result = _run(sys.argv[1], sys.argv[2])
    if os.environ['RANK'] == '0':
        print(json.dumps(result))
    shutdown_distributed()
