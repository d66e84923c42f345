# GPT-nano trained with FSDP2 (torch's fully_shard; one unit per TransformerBlock).
# Launch: bash tools/dist_train.sh configs/gpt-nano_fsdp2_2xcpu.py 2
_base_ = [
    '_base_/models/gpt_nano.py',
    '_base_/datasets/stdlib_chars.py',
    '_base_/schedules/iter_based.py',
    '_base_/default_runtime.py',
]

runner_type = 'mmfsdp.FSDPRunner'
model_wrapper_cfg = dict(
    type='mmfsdp.MMFullyShard',
    auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
)
