"""``mixed_precision.fp32_modules`` resolved against the model: what it keeps, its errors, its plan.

Which norms are kept by default and by name, nothing without low-precision
compute, the errors naming the key, and the plan's fp32 units. What the kept
modules compute is checked on real process groups in ``tests/dist/test_fp32_norms.py``.
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
from torch.nn.modules.batchnorm import _BatchNorm

from mmfsdp import MMFullyShard, MMFullyShardedDataParallel
from mmfsdp.plan.memory import make_plan
from mmfsdp.plan.spec import sharding_spec
from mmfsdp.wrappers import FSDPConfig, FullyShardConfig
from vision import GroupNormNet, tiny_resnet

WORLD_SIZE = 2
BF16 = dict(param_dtype='bf16', reduce_dtype='fp32')
BLOCKS = dict(type='transformer', layer_cls=['Block'])


def test_default_keeps_every_batch_norm():
    for config in (FullyShardConfig, FSDPConfig):
        cfg = config.from_dict(dict(mixed_precision=BF16))
        assert cfg.fp32_modules == (_BatchNorm, )
        assert cfg.layout(tiny_resnet()).fp32_modules == (
            'bn', 'blocks.0.bn1', 'blocks.0.bn2', 'blocks.1.bn1', 'blocks.1.bn2')
    sync = nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2))
    assert FullyShardConfig.from_dict(dict(mixed_precision=BF16)).layout(sync).fp32_modules \
        == ('1', )


def test_nothing_is_kept_without_low_precision_compute():
    for mp in (None, dict(reduce_dtype='bf16'), dict(param_dtype='fp32')):
        assert FullyShardConfig.from_dict(dict(mixed_precision=mp)).layout(
            tiny_resnet()).fp32_modules == ()
    assert FSDPConfig.from_dict({}).layout(tiny_resnet()).fp32_modules == ()


def test_names_and_classes_resolve_against_the_model():
    cfg = FullyShardConfig.from_dict(dict(mixed_precision=dict(
        BF16, fp32_modules=['GroupNorm', nn.LayerNorm])))
    assert cfg.mixed_precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
    assert cfg.fp32_modules == ('GroupNorm', nn.LayerNorm)
    assert cfg.layout(GroupNormNet()).fp32_modules == ('gn', 'ln')
    # a base-class name covers its subclasses; [] keeps nothing
    for value, kept in ((['_BatchNorm'], 5), ('BatchNorm2d', 5), ([], 0)):
        cfg = FullyShardConfig.from_dict(dict(mixed_precision=dict(BF16, fp32_modules=value)))
        assert len(cfg.layout(tiny_resnet()).fp32_modules) == kept


def test_fsdp1_mixed_precision_object_brings_its_classes():
    mp = MixedPrecision(param_dtype=torch.bfloat16, _module_classes_to_ignore=(nn.GroupNorm, ))
    cfg = FSDPConfig.from_dict(dict(mixed_precision=mp))
    assert cfg.fp32_modules == (nn.GroupNorm, )
    assert cfg.layout(GroupNormNet()).fp32_modules == ('gn', )


@pytest.mark.parametrize('value, error, fragment', [
    (dict(BF16, fp32_modules=None), TypeError,
     'mixed_precision.fp32_modules: None is ambiguous'),
    (dict(BF16, fp32_modules=3), TypeError,
     'mixed_precision.fp32_modules: expected a list of module class names'),
    (dict(BF16, fp32_modules=['GroupNorm', 1]), TypeError,
     'expected module class names'),
    (dict(BF16, fp32_module=['GroupNorm']), TypeError,
     "unknown key 'fp32_module' (did you mean 'fp32_modules'?)")])
def test_bad_values_name_the_key(value, error, fragment):
    for config in (FullyShardConfig, FSDPConfig):
        with pytest.raises(error) as e:
            config.from_dict(dict(mixed_precision=value))
        assert fragment in str(e.value)


def test_unknown_class_names_suggest_the_nearest():
    for config in (FullyShardConfig, FSDPConfig):
        cfg = config.from_dict(dict(mixed_precision=dict(BF16, fp32_modules=['BatchNrom2d'])))
        with pytest.raises(ValueError) as e:
            cfg.layout(tiny_resnet())
        message = str(e.value)
        assert 'mixed_precision.fp32_modules' in message and "'BatchNrom2d'" in message
        assert "close matches: ['BatchNorm2d'" in message


def test_fp32_modules_at_the_top_level_points_into_mixed_precision():
    with pytest.raises(TypeError, match="'fp32_modules' is a key of mixed_precision"):
        FullyShardConfig.from_dict(dict(fp32_modules=['GroupNorm']))


def test_a_parameter_shared_across_the_fp32_boundary_is_refused():
    model = GroupNormNet()
    model.tied = nn.Linear(8, 8, bias=False)
    model.tied.weight = model.gn.weight  # shape (8,) vs (8, 8): only the registration matters
    cfg = FullyShardConfig.from_dict(dict(mixed_precision=dict(BF16,
                                                                fp32_modules=['GroupNorm'])))
    with pytest.raises(ValueError) as e:
        cfg.layout(model)
    assert 'gn.weight = tied.weight' in str(e.value) and 'kept in fp32 (gn)' in str(e.value)


def test_the_plan_counts_kept_modules_in_fp32():
    for wrapper in (MMFullyShard, MMFullyShardedDataParallel):
        config = wrapper.CONFIG.from_dict(dict(auto_wrap_policy=BLOCKS, mixed_precision=BF16))
        spec = sharding_spec(config, config.layout(tiny_resnet()), WORLD_SIZE)
        assert spec.fp32_units == ('bn', 'blocks.0.bn1', 'blocks.0.bn2', 'blocks.1.bn1',
                                   'blocks.1.bn2')
        assert spec.units.index('blocks.0.bn1') < spec.units.index('blocks.0')
        plan = make_plan(tiny_resnet(), spec, WORLD_SIZE)
        units = {u.name: u for u in plan.units}
        assert units['blocks.0.bn1'].numel == 16
        assert units['blocks.0.bn1'].gathered_bytes == 16 * 4  # fp32
        assert units['blocks.0'].numel == 2 * 8 * 8 * 9  # the convolutions only
        assert units['blocks.0'].gathered_bytes == 2 * 8 * 8 * 9 * 2  # bf16
        assert units[''].numel == 3 * 8 * 9 + 8 * 4 + 4  # stem + head; its BN is a unit
