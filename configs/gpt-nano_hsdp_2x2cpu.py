# GPT-nano trained with hybrid sharding (HSDP, FSDP2): 2 "nodes" x 2 processes.
# Parameters are sharded over the 2 processes of a node and replicated across
# the nodes: gradients are reduce-scattered inside a node, then all-reduced
# between the replicas.
# Launch, on node i of 2 (MASTER_ADDR: node 0's address):
#   NNODES=2 NODE_RANK=i MASTER_ADDR=... bash tools/dist_train.sh configs/gpt-nano_hsdp_2x2cpu.py 2
# or on one machine: bash tools/dist_train.sh configs/gpt-nano_hsdp_2x2cpu.py 4
_base_ = [
    '_base_/models/gpt_nano.py',
    '_base_/datasets/stdlib_chars.py',
    '_base_/schedules/iter_based.py',
    '_base_/default_runtime.py',
]

runner_type = 'mmfsdp.FSDPRunner'
model_wrapper_cfg = dict(
    type='mmfsdp.MMFullyShard',
    # Ranks are laid out node by node, so the last (shard) dimension of the
    # 2 x 2 mesh is the 2 processes of one node.
    mesh=dict(replicate=2, shard=2),
    auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
)
