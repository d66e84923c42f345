# Python-style twin of configs/gpt-nano_fsdp2_2xcpu.py: GPT-nano trained with
# FSDP2 (torch's fully_shard; one unit per TransformerBlock).
# Launch: bash tools/dist_train.sh configs/py/gpt_nano_fsdp2_2xcpu.py 2
from mmengine.config import read_base

from mmfsdp import FSDPRunner, MMFullyShard

with read_base():
    from ._base_.datasets.stdlib_chars import *  # noqa: F401,F403
    from ._base_.default_runtime import *  # noqa: F401,F403
    from ._base_.models.gpt_nano import *  # noqa: F401,F403
    from ._base_.schedules.iter_based import *  # noqa: F401,F403

runner_type = FSDPRunner
model_wrapper_cfg = dict(
    type=MMFullyShard,
    # Names in lists: mmengine leaves imported objects inside a list unbuilt.
    auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
)
