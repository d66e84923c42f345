# Python-style twin of configs/gpt-nano_hsdp_2x2cpu.py: hybrid sharding (HSDP,
# FSDP2), 2 "nodes" x 2 processes; sharded inside a node, replicated across.
# Launch, on node i of 2:
#   NNODES=2 NODE_RANK=i MASTER_ADDR=... bash tools/dist_train.sh configs/py/gpt_nano_hsdp_2x2cpu.py 2
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
    # The last (shard) mesh dimension is the processes of one node.
    mesh=dict(replicate=2, shard=2),
    # Names in lists: mmengine leaves imported objects inside a list unbuilt.
    auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
)
