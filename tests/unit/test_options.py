"""Every config string is resolved in mmfsdp.options, with errors naming key, value, choices."""
import pytest
import torch
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

from mmfsdp.options import check_keys, resolve_dtype
from mmfsdp.wrappers import FSDPConfig
from mmfsdp.wrappers.fsdp import (
    resolve_backward_prefetch,
    resolve_cpu_offload,
    resolve_mixed_precision,
)


def resolve_sharding_strategy(value):
    """``sharding_strategy`` as FSDPConfig resolves it (by its type, ShardingStrategy)."""
    return FSDPConfig.from_dict(dict(sharding_strategy=value)).sharding_strategy


@pytest.mark.parametrize('name, dtype', [
    ('bf16', torch.bfloat16), ('bfloat16', torch.bfloat16), ('BF16', torch.bfloat16),
    ('fp16', torch.float16), ('float16', torch.float16),
    ('fp32', torch.float32), ('float32', torch.float32),
    (torch.bfloat16, torch.bfloat16), (None, None),
])
def test_dtype_names_and_values_are_accepted(name, dtype):
    assert resolve_dtype(name, 'param_dtype') is dtype


def test_unknown_dtype_names_the_key_value_and_choices():
    with pytest.raises(ValueError) as e:
        resolve_dtype('bf17', 'mixed_precision.param_dtype')
    msg = str(e.value)
    assert 'mixed_precision.param_dtype' in msg and "'bf17'" in msg
    assert "did you mean 'bf16'" in msg and "'float32'" in msg


@pytest.mark.parametrize('value', ['nn', 'int8', 'Tensor'])
def test_torch_attribute_names_are_not_dtypes(value):
    with pytest.raises(ValueError):
        resolve_dtype(value, 'param_dtype')


def test_integer_dtype_is_rejected():
    with pytest.raises(ValueError, match='floating-point'):
        resolve_dtype(torch.int64, 'param_dtype')


@pytest.mark.parametrize('name', ['FULL_SHARD', 'full_shard', 'Shard_Grad_Op', 'NO_SHARD',
                                  'HYBRID_SHARD'])
def test_sharding_strategy_is_case_insensitive(name):
    assert resolve_sharding_strategy(name) is ShardingStrategy[name.upper()]


def test_sharding_strategy_typo_suggests_the_member():
    with pytest.raises(ValueError) as e:
        resolve_sharding_strategy('FULLSHARD')
    msg = str(e.value)
    assert msg.startswith('model_wrapper_cfg.sharding_strategy:') and "'FULLSHARD'" in msg
    assert "did you mean 'FULL_SHARD'" in msg and "'SHARD_GRAD_OP'" in msg


def test_sharding_strategy_member_passes_through():
    assert resolve_sharding_strategy(ShardingStrategy.NO_SHARD) is ShardingStrategy.NO_SHARD


@pytest.mark.parametrize('value, expected', [
    ('pre', BackwardPrefetch.BACKWARD_PRE), ('POST', BackwardPrefetch.BACKWARD_POST),
    ('backward_pre', BackwardPrefetch.BACKWARD_PRE), (None, None),
    (BackwardPrefetch.BACKWARD_POST, BackwardPrefetch.BACKWARD_POST),
])
def test_backward_prefetch_values(value, expected):
    assert resolve_backward_prefetch(value) is expected


def test_bad_backward_prefetch_lists_choices():
    with pytest.raises(ValueError) as e:
        resolve_backward_prefetch('middle')
    msg = str(e.value)
    assert 'backward_prefetch' in msg and "'middle'" in msg and "'pre'" in msg and "'post'" in msg


def test_mixed_precision_dict_becomes_mixed_precision():
    mp = resolve_mixed_precision(dict(param_dtype='bf16', reduce_dtype='fp32',
                                      buffer_dtype='float32', cast_forward_inputs=True))
    assert mp == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                buffer_dtype=torch.float32, cast_forward_inputs=True)


def test_mixed_precision_unknown_key_lists_valid_keys():
    with pytest.raises(TypeError) as e:
        resolve_mixed_precision(dict(param_dtype='bf16', compute_dtype='bf16'))
    msg = str(e.value)
    assert 'mixed_precision' in msg and "'compute_dtype'" in msg and "'reduce_dtype'" in msg


def test_mixed_precision_bad_dtype_names_nested_key():
    with pytest.raises(ValueError, match=r"mixed_precision\.param_dtype: 'bf17'"):
        resolve_mixed_precision(dict(param_dtype='bf17'))


@pytest.mark.parametrize('value, offload', [
    (False, False), (True, True), (dict(offload_params=True), True),
    (CPUOffload(offload_params=True), True)])
def test_cpu_offload_values(value, offload):
    assert resolve_cpu_offload(value).offload_params is offload


@pytest.mark.parametrize('value', ['yes', 1, None])
def test_cpu_offload_rejects_non_booleans(value):
    with pytest.raises(TypeError) as e:
        resolve_cpu_offload(value)
    assert 'cpu_offload' in str(e.value) and repr(value) in str(e.value)


def test_check_keys_suggests_the_closest_key():
    with pytest.raises(TypeError, match="did you mean 'sharding_strategy'"):
        check_keys(dict(sharding_stratgy='x'), ['sharding_strategy', 'cpu_offload'], 'cfg')


def test_fsdp_config_resolves_strings_to_torch_values():
    cfg = FSDPConfig.from_dict(dict(sharding_strategy='shard_grad_op', backward_prefetch='post',
                                    mixed_precision=dict(param_dtype='bf16'), cpu_offload=False))
    assert cfg.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert cfg.backward_prefetch is BackwardPrefetch.BACKWARD_POST
    assert cfg.mixed_precision.param_dtype is torch.bfloat16
    assert cfg.cpu_offload == CPUOffload(offload_params=False)


def test_fsdp_config_defaults():
    cfg = FSDPConfig.from_dict({})
    assert cfg.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert cfg.backward_prefetch is BackwardPrefetch.BACKWARD_PRE
    assert cfg.mixed_precision is None and cfg.auto_wrap_policy is None


def test_fsdp_config_unknown_keyword_lists_valid_keywords():
    with pytest.raises(TypeError) as e:
        FSDPConfig.from_dict(dict(sharding_strategy='FULL_SHARD', use_orig_param=True))
    msg = str(e.value)
    assert 'model_wrapper_cfg' in msg and "'use_orig_param'" in msg and "'cpu_offload'" in msg


def test_fsdp_config_rejects_non_boolean_flags():
    with pytest.raises(TypeError, match="limit_all_gathers: expected True or False, got str 'no'"):
        FSDPConfig.from_dict(dict(limit_all_gathers='no'))
