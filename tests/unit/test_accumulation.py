"""The ``accumulation`` option: resolved with its default, refused where it cannot work, planned.

What the modes train is checked on real process groups in ``tests/dist/test_accumulation.py``.
"""

import pytest

COUNTS = 2
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
FSDP1 = 'mmfsdp.MMFullyShardedDataParallel'
FSDP2 = 'mmfsdp.MMFullyShard'


def _wrapper(kind: str, mode: str, **extra) -> dict:
    return dict(type=kind, auto_wrap_policy=BLOCKS, accumulation=mode, **extra)


def test_fsdp1_refuses_hybrid_accumulation_naming_fsdp2():
    from mmfsdp.wrappers.fsdp import FSDPConfig
    with pytest.raises(ValueError, match=r"accumulation='hybrid'.*FSDP1.*MMFullyShard"):
        FSDPConfig.from_dict(dict(sharding_strategy='HYBRID_SHARD', accumulation='hybrid'))


@pytest.mark.parametrize('kind', ['fsdp1', 'fsdp2'])
def test_accumulation_option_is_resolved_and_defaults_to_sharded(kind):
    from mmfsdp.options import Accumulation
    from mmfsdp.wrappers.fsdp import FSDPConfig
    from mmfsdp.wrappers.fsdp2 import FullyShardConfig
    config = FSDPConfig if kind == 'fsdp1' else FullyShardConfig
    assert config.from_dict({}).accumulation is Accumulation.SHARDED
    assert config.from_dict(dict(accumulation='Unsharded')).accumulation is Accumulation.UNSHARDED
    with pytest.raises(ValueError, match=r"model_wrapper_cfg\.accumulation: 'shard' is not "
                                         r"valid \(did you mean 'sharded'\?\)"):
        config.from_dict(dict(accumulation='shard'))
    with pytest.raises(TypeError, match=r'model_wrapper_cfg\.accumulation: expected'):
        config.from_dict(dict(accumulation=True))


@pytest.mark.parametrize('kind', [FSDP1, FSDP2])
def test_plan_gradient_bytes_follow_the_mode_when_accumulating(kind):
    from mmfsdp.plan import plan_for
    from mmfsdp.registry import MODEL_WRAPPERS
    from toy import ToyClassifier
    model = ToyClassifier()
    wrapper_cls = MODEL_WRAPPERS.get(kind.split('.')[-1])

    def grad_bytes(mode: str, counts: int) -> int:
        plan = plan_for(wrapper_cls, _wrapper(kind, mode), model, 2, dict(type='AdamW'),
                        accumulative_counts=counts)
        return sum(u.grad_bytes for u in plan.units)

    full = sum(p.numel() for p in model.parameters()) * 4
    assert grad_bytes('unsharded', COUNTS) == full  # every rank holds whole gradients
    for mode, counts in (('sharded', COUNTS), ('sharded', 1), ('unsharded', 1)):
        assert grad_bytes(mode, counts) <= full / 2 + 64  # the shard (and its padding)
