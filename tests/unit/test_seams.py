"""The seams between mmfsdp's parts that need no process group.

- one base class for mmfsdp's wrappers (:mod:`mmfsdp.wrappers.base`); other
  wrappers are driven as mmengine drives them;
- one optim-wrapper iterator; FSDP1 and FSDP2 cut a model into the same units;
- the wrap preconditions apply in ``train()`` only.
"""

import pytest
import torch
from mmengine.model import MMDistributedDataParallel as MMEngineDDP
from mmengine.optim import OptimWrapper, OptimWrapperDict
from torch import nn

from mmfsdp import (
    MMFullyShard,
)
from mmfsdp.optim import named_optim_wrappers
from mmfsdp.plan import plan_for
from mmfsdp.runner import LifecycleError, WrapPreconditions
from mmfsdp.wrappers import FSDPConfig, FullyShardConfig
from mmfsdp.wrappers.base import ParallelWrapper
from mmfsdp.wrappers.builder import resolve_wrapper
from toy import ToyBlock, ToyClassifier

BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])


def test_other_wrappers_are_driven_as_mmengine_drives_them():
    assert not issubclass(MMEngineDDP, ParallelWrapper)
    theirs = resolve_wrapper(dict(type=MMEngineDDP, init_device='meta'))
    assert not theirs.ours and not theirs.config.offloads_to_cpu and not theirs.meta_init
    assert theirs.layout(ToyClassifier()) is None
    assert resolve_wrapper(dict(type=MMFullyShard, init_device='meta')).meta_init
    with pytest.raises(TypeError, match='has no sharding plan'):
        plan_for(MMEngineDDP, dict(type=MMEngineDDP), ToyClassifier(), 2)


def test_one_optim_wrapper_iterator():
    one, gen, disc = (OptimWrapper(optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1))
                      for _ in range(3))
    assert list(named_optim_wrappers(one)) == [(None, one)]
    pairs = list(named_optim_wrappers(OptimWrapperDict(generator=gen, discriminator=disc)))
    assert pairs == [('generator', gen), ('discriminator', disc)]


def test_fsdp1_and_fsdp2_cut_a_model_into_the_same_units():
    options = dict(auto_wrap_policy=BLOCKS, activation_checkpointing=dict(layer_cls=['ToyBlock']))
    one, two = (cls.from_dict(options).layout(ToyClassifier())
                for cls in (FSDPConfig, FullyShardConfig))
    assert one.units == two.units and one.units and one.checkpoint_layers == (ToyBlock, )
    for cls in (FSDPConfig, FullyShardConfig):
        with pytest.raises(ValueError, match="'ToyBlok'"):
            cls.from_dict(dict(auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlok']))
                          ).layout(ToyClassifier())


def test_wrap_preconditions_apply_in_train_only():
    pre = WrapPreconditions()
    pre.check(dict(type='OptimWrapper'))  # val() / test(): nothing to check
    with pre.phase('train'), pytest.raises(LifecycleError) as info:
        pre.check(dict(type='OptimWrapper'))
    assert 'optim wrapper is not built' in str(info.value)
    assert 'weights are not initialised' in str(info.value)


def test_ddp_options_resolve_through_the_base_config():
    ddp = 'mmfsdp.MMDistributedDataParallel'
    config = resolve_wrapper(dict(type=ddp, broadcast_buffers=True, static_graph=True,
                                  detect_anomalous_params=True)).config
    assert config.detect_anomalous_params is True
    assert config.ddp_kwargs == dict(forward_sync_buffers=True, static_graph=True,
                                     gradient_as_bucket_view=True)
    with pytest.raises(TypeError, match='model_wrapper_cfg.detect_anomalous_params: '
                                        "expected True or False, got str 'yes'"):
        resolve_wrapper(dict(type=ddp, detect_anomalous_params='yes'))
    with pytest.raises(TypeError, match="unknown key 'static_grap' \\(did you mean 'static_graph'"):
        resolve_wrapper(dict(type=ddp, static_grap=True))


def test_ddp_refuses_mixed_precision_at_resolve_naming_what_to_use():
    """torch's DDP takes a private mixed_precision dataclass; the config's dict reached it and
    failed after the first collectives ('dict' object has no attribute 'param_dtype')."""
    with pytest.raises(ValueError, match="model_wrapper_cfg.mixed_precision=.*keeps fp32 "
                                         ".*mmfsdp.AmpOptimWrapper"):
        resolve_wrapper(dict(type='mmfsdp.MMDistributedDataParallel',
                             mixed_precision=dict(param_dtype='bf16')))
