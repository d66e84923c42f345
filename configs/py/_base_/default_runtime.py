# Python-style twin of configs/_base_/default_runtime.py: hooks, logging,
# environment, seed.
from mmengine.hooks import (
                            CheckpointHook,
                            DistSamplerSeedHook,
                            IterTimerHook,
                            LoggerHook,
                            ParamSchedulerHook,
)
from mmengine.runner import LogProcessor
from mmengine.visualization import LocalVisBackend, Visualizer

default_hooks = dict(
    timer=dict(type=IterTimerHook),
    logger=dict(type=LoggerHook, interval=20),
    param_scheduler=dict(type=ParamSchedulerHook),
    # No periodic checkpoints (interval=-1): save_last writes exactly one at
    # the end of training, whatever train_cfg.max_iters is set to.
    checkpoint=dict(
        type=CheckpointHook,
        by_epoch=False,
        interval=-1,
        save_last=True,
        max_keep_ckpts=1),
    sampler_seed=dict(type=DistSamplerSeedHook),
)

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    # No backend on purpose: the runner picks gloo on CPU and nccl on GPU.
    dist_cfg=dict(timeout=300),
)

vis_backends = [dict(type=LocalVisBackend)]
visualizer = dict(type=Visualizer, vis_backends=vis_backends)

log_processor = dict(type=LogProcessor, window_size=20, by_epoch=False)
log_level = 'INFO'
load_from = None
resume = False

randomness = dict(seed=0)
