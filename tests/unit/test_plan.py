"""The sharding plan's arithmetic on meta-device models: every parameter once, shards shrinking
with the world size, warnings for plans that do not shard.
"""

import torch
from torch import nn

from mmfsdp.plan import format_plan, plan_for, plan_to_dict
from mmfsdp.wrappers import MMFullyShardedDataParallel
from toy import FSDP1, meta_toy

FSDP = 'mmfsdp.MMFullyShardedDataParallel'
ADAMW = dict(type='AdamW', lr=1e-2)


def test_plan_of_the_demo_gpt_counts_every_parameter_once():
    from mmfsdp.demo import GPT
    with torch.device('meta'):
        model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    wrapper = dict(type=FSDP, auto_wrap_policy=dict(type='transformer',
                                                    layer_cls=['TransformerBlock']))
    plan = plan_for(MMFullyShardedDataParallel, wrapper, model, 8, ADAMW)
    assert plan.numel == sum(p.numel() for p in model.parameters())  # tied weight once
    assert [u.name for u in plan.units] == ['', 'blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']
    assert plan.shared == (('wte.weight', 'lm_head.weight'), )
    assert plan.largest_unit.name == 'blocks.0'
    table = format_plan(plan)
    assert 'world size 8' in table and 'wte.weight = lm_head.weight' in table
    assert 'activations not included' in table


def test_full_shard_model_states_shrink_with_world_size():
    wrapper = FSDP1
    one, eight = (plan_for(MMFullyShardedDataParallel, wrapper, meta_toy(), n, ADAMW)
                  for n in (1, 8))
    assert one.model_state_bytes_per_rank == one.unsharded_bytes == 16 * one.numel
    assert eight.model_state_bytes_per_rank <= 1.05 * 16 * eight.numel / 8 + 8 * 4 * 4 * 5


def test_a_plan_that_keeps_most_parameters_in_the_root_warns():
    wrapper = dict(type=FSDP, auto_wrap_policy=dict(type='module_types', module_cls=['LayerNorm']))
    plan = plan_to_dict(plan_for(MMFullyShardedDataParallel, wrapper, meta_toy(), 2, ADAMW))
    assert any('root unit keeps' in w and 'layer_cls' in w for w in plan['warnings'])


def test_a_plan_with_too_many_units_warns():
    with torch.device('meta'):
        model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(1001)])
    wrapper = dict(type=FSDP, auto_wrap_policy=dict(type='module_types', module_cls=['Linear']))
    plan = plan_to_dict(plan_for(MMFullyShardedDataParallel, wrapper, model, 2, ADAMW))
    assert any('1001 units' in w and 'min_num_params' in w for w in plan['warnings'])
