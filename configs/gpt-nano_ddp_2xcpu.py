# GPT-nano trained with DDP: the baseline the FSDP config is compared with.
# Launch: bash tools/dist_train.sh configs/gpt-nano_ddp_2xcpu.py 2
_base_ = [
    '_base_/models/gpt_nano.py',
    '_base_/datasets/stdlib_chars.py',
    '_base_/schedules/iter_based.py',
    '_base_/default_runtime.py',
]

runner_type = 'mmfsdp.FSDPRunner'
model_wrapper_cfg = dict(type='mmfsdp.MMDistributedDataParallel')
