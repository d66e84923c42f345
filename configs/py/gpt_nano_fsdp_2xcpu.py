# Python-style twin of configs/gpt-nano_fsdp_2xcpu.py: GPT-nano trained with
# FSDP (FULL_SHARD, one unit per TransformerBlock).
# Launch: bash tools/dist_train.sh configs/py/gpt_nano_fsdp_2xcpu.py 2
from mmengine.config import read_base

from mmfsdp import FSDPRunner, MMFullyShardedDataParallel

with read_base():
    from ._base_.datasets.stdlib_chars import *  # noqa: F401,F403
    from ._base_.default_runtime import *  # noqa: F401,F403
    from ._base_.models.gpt_nano import *  # noqa: F401,F403
    from ._base_.schedules.iter_based import *  # noqa: F401,F403

runner_type = FSDPRunner
model_wrapper_cfg = dict(
    type=MMFullyShardedDataParallel,
    sharding_strategy='FULL_SHARD',
    # A name, not the class: mmengine builds the imported objects that are
    # dict values, but leaves those inside a list as unbuilt LazyObjects.
    auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
)
