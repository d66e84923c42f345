# Python-style twin of configs/gpt-nano_ddp_2xcpu.py: GPT-nano trained with
# DDP, the baseline the FSDP config is compared with.
# Launch: bash tools/dist_train.sh configs/py/gpt_nano_ddp_2xcpu.py 2
from mmengine.config import read_base

from mmfsdp import FSDPRunner, MMDistributedDataParallel

with read_base():
    from ._base_.datasets.stdlib_chars import *  # noqa: F401,F403
    from ._base_.default_runtime import *  # noqa: F401,F403
    from ._base_.models.gpt_nano import *  # noqa: F401,F403
    from ._base_.schedules.iter_based import *  # noqa: F401,F403

runner_type = FSDPRunner
model_wrapper_cfg = dict(type=MMDistributedDataParallel)
