"""FSDP2 options: resolvers, FSDP1 translations, their errors, and the tied-parameter unit plan.

Single process, no process group.
"""
import pytest
import torch
from mmengine.model import is_model_wrapper
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
)

from mmfsdp import MMFullyShard
from mmfsdp.demo import GPT
from mmfsdp.options import resolve_init_device
from mmfsdp.plan.spec import sharding_spec
from mmfsdp.policies import (
    ROOT,
    build_wrap_policy,
    merge_units_sharing_parameters,
    plan_units,
    within,
)
from mmfsdp.wrappers import FSDPConfig, FullyShardConfig
from mmfsdp.wrappers.base import MeshSpec
from mmfsdp.wrappers.builder import resolve_wrapper
from mmfsdp.wrappers.fsdp2 import (
    FSDP1_ONLY_OPTIONS,
    resolve_mesh,
    resolve_mp_policy,
    resolve_offload_policy,
    resolve_reshard_after_forward,
)
from toy import ToyClassifier


def test_mixed_precision_dict_becomes_a_policy():
    mp = resolve_mp_policy(dict(param_dtype='bf16', reduce_dtype='fp32', output_dtype='float32',
                                cast_forward_inputs=False))
    assert mp == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32, cast_forward_inputs=False)
    assert resolve_mp_policy(None) == MixedPrecisionPolicy()


def test_an_unset_reduce_dtype_is_written_out_as_param_dtype():
    """torch 2.15 reduces in the gradients' dtype where ``reduce_dtype`` is unset, 2.13 in
    ``param_dtype``: the resolved policy says ``param_dtype`` (FSDP1's meaning) on both."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert resolve_mp_policy(dict(param_dtype='bf16')) == bf16
    assert resolve_mp_policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16)) == bf16
    assert resolve_mp_policy(dict(reduce_dtype='fp32')).param_dtype is None
    assert resolve_mp_policy({}).reduce_dtype is None  # parameters' own dtype, every torch


@pytest.mark.parametrize('key, hint', [('buffer_dtype', 'does not cast buffers'),
                                       ('keep_low_precision_grads', 'reduce_dtype'),
                                       ('cast_root_forward_inputs', 'use cast_forward_inputs')])
def test_fsdp1_mixed_precision_keys_say_what_to_do(key, hint):
    with pytest.raises(TypeError) as e:
        resolve_mp_policy({key: 'fp32' if 'dtype' in key else True})
    assert f'mixed_precision: {key!r} is an FSDP1 key' in str(e.value) and hint in str(e.value)


def test_fsdp1_mixed_precision_object_is_rejected():
    with pytest.raises(TypeError, match='MixedPrecisionPolicy'):
        resolve_mp_policy(MixedPrecision(param_dtype=torch.bfloat16))


def test_mixed_precision_typos_name_the_key():
    with pytest.raises(ValueError, match=r"mixed_precision\.param_dtype: 'bf17'.*'bf16'"):
        resolve_mp_policy(dict(param_dtype='bf17'))
    with pytest.raises(TypeError, match="'compute_dtype'.*'param_dtype'"):
        resolve_mp_policy(dict(compute_dtype='bf16'))


@pytest.mark.parametrize('value, expected', [
    (None, OffloadPolicy()), (False, OffloadPolicy()), (True, CPUOffloadPolicy()),
    (dict(cpu_offload=False), OffloadPolicy()),
    (dict(cpu_offload=True, pin_memory=False), CPUOffloadPolicy(pin_memory=False)),
    (CPUOffloadPolicy(pin_memory=False), CPUOffloadPolicy(pin_memory=False))])
def test_offload_values(value, expected):
    resolved = resolve_offload_policy(value)
    assert type(resolved) is type(expected) and resolved == expected


@pytest.mark.parametrize('value, error, fragment', [
    ('yes', TypeError, "offload: expected dict(cpu_offload=..., pin_memory=...)"),
    (dict(cpu_offload='yes'), TypeError, "offload.cpu_offload: expected True or False"),
    (dict(offload_params=True), TypeError, "unknown key 'offload_params'"),
    (dict(pin_memory=False), ValueError, 'only applies with cpu_offload=True')])
def test_bad_offload_values(value, error, fragment):
    with pytest.raises(error) as e:
        resolve_offload_policy(value)
    assert fragment in str(e.value)


@pytest.mark.parametrize('value', [True, False, 2, 8])
def test_reshard_after_forward_values(value):
    assert resolve_reshard_after_forward(value) == value


@pytest.mark.parametrize('value, error', [(1, ValueError), (0, ValueError), ('yes', TypeError),
                                          (None, TypeError)])
def test_bad_reshard_after_forward(value, error):
    with pytest.raises(error, match='reshard_after_forward'):
        resolve_reshard_after_forward(value)


@pytest.mark.parametrize('mesh, world, local, sizes', [
    (dict(), 4, None, (1, 4)), (dict(replicate=2, shard=2), 4, None, (2, 2)),
    (dict(replicate=2), 8, None, (2, 4)), (dict(replicate=-1, shard=2), 8, None, (4, 2)),
    (dict(replicate=-1, shard='node'), 8, 4, (2, 4))])
def test_mesh_sizes(mesh, world, local, sizes):
    assert resolve_mesh(mesh).sizes(world, local) == sizes


def test_nodes_of_different_sizes_are_named_as_such(monkeypatch):
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '3')
    for config in (FullyShardConfig.from_dict(dict(mesh=dict(replicate=-1, shard='node'))),
                   FSDPConfig.from_dict(dict(sharding_strategy='HYBRID_SHARD'))):
        with pytest.raises(ValueError, match='LOCAL_WORLD_SIZE: 3 ranks per node do not divide '
                                             'the world size 4'):
            sharding_spec(config, config.layout(ToyClassifier()), 4)


def test_mesh_that_does_not_fit_the_world_says_so():
    with pytest.raises(ValueError) as e:
        resolve_mesh(dict(replicate=3, shard=2)).sizes(4)
    msg = str(e.value)
    assert 'replicate=3 x shard=2' in msg and 'world size 4' in msg
    with pytest.raises(ValueError, match='world size 4'):
        resolve_mesh(dict(replicate=3)).sizes(4)


@pytest.mark.parametrize('mesh, fragment', [
    (dict(replicate=0), 'mesh.replicate: expected a positive int'),
    (dict(shard=True), 'mesh.shard: expected a positive int'),
    (dict(replicate='node'), 'mesh.replicate'),
    (dict(replicas=2), "did you mean 'replicate'"),
    ([2, 2], 'mesh: expected dict(replicate=..., shard=...)')])
def test_bad_mesh(mesh, fragment):
    with pytest.raises((TypeError, ValueError)) as e:
        resolve_mesh(mesh)
    assert fragment in str(e.value)


@pytest.mark.parametrize('strategy, expected', [
    ('FULL_SHARD', (True, False)), ('shard_grad_op', (False, False)),
    ('HYBRID_SHARD', (True, True)), ('_HYBRID_SHARD_ZERO2', (False, True))])
def test_sharding_strategy_translation(strategy, expected):
    cfg = FullyShardConfig.from_dict(dict(sharding_strategy=strategy))
    assert (cfg.reshard_after_forward, cfg.mesh.replicate != 1) == expected


def test_no_shard_points_to_ddp():
    with pytest.raises(ValueError, match="NO_SHARD.*mmfsdp.MMDistributedDataParallel"):
        FullyShardConfig.from_dict(dict(sharding_strategy='NO_SHARD'))


def test_init_device():
    assert resolve_init_device(None) is None and resolve_init_device('meta') == 'meta'
    with pytest.raises(ValueError, match="init_device: 'meat'.*did you mean 'meta'"):
        resolve_init_device('meat')


# ------------------------------------------------------------------ the config

def test_config_defaults():
    cfg = FullyShardConfig.from_dict({})
    assert cfg.reshard_after_forward is True and cfg.mesh == MeshSpec(1, -1)
    assert cfg.mixed_precision == MixedPrecisionPolicy()
    assert type(cfg.offload) is OffloadPolicy and cfg.init_device is None


@pytest.mark.parametrize('key', list(FSDP1_ONLY_OPTIONS))
def test_fsdp1_only_options_say_what_to_use_instead(key):
    with pytest.raises(TypeError) as e:
        FullyShardConfig.from_dict({key: True})
    msg = str(e.value)
    assert f"model_wrapper_cfg: '{key}' is an FSDP1 option" in msg
    assert FSDP1_ONLY_OPTIONS[key] in msg


def test_cpu_offload_points_to_offload():
    with pytest.raises(TypeError, match=r'use offload=dict\(cpu_offload=True'):
        FullyShardConfig.from_dict(dict(cpu_offload=True))


@pytest.mark.parametrize('strategy, reshard, mesh', [
    ('FULL_SHARD', True, MeshSpec()), ('SHARD_GRAD_OP', False, MeshSpec()),
    ('HYBRID_SHARD', True, MeshSpec(replicate=-1, shard='node')),
    ('_HYBRID_SHARD_ZERO2', False, MeshSpec(replicate=-1, shard='node'))])
def test_config_translates_sharding_strategy(strategy, reshard, mesh):
    cfg = FullyShardConfig.from_dict(dict(sharding_strategy=strategy))
    assert cfg.reshard_after_forward is reshard and cfg.mesh == mesh


def test_hybrid_strategy_keeps_an_explicit_mesh():
    cfg = FullyShardConfig.from_dict(dict(sharding_strategy='HYBRID_SHARD',
                                          mesh=dict(replicate=2, shard=4)))
    assert cfg.mesh == MeshSpec(2, 4)
    with pytest.raises(ValueError, match='mesh has replicate=1'):
        FullyShardConfig.from_dict(dict(sharding_strategy='HYBRID_SHARD', mesh=dict(shard=4)))


def test_sharding_strategy_and_reshard_after_forward_conflict():
    with pytest.raises(TypeError, match='not both'):
        FullyShardConfig.from_dict(dict(sharding_strategy='FULL_SHARD',
                                        reshard_after_forward=False))


def test_unknown_keyword_suggests_the_closest():
    with pytest.raises(TypeError) as e:
        FullyShardConfig.from_dict(dict(reshard_after_foward=True))
    msg = str(e.value)
    assert "'reshard_after_foward'" in msg and "did you mean 'reshard_after_forward'" in msg


def test_the_layout_checks_model_dependent_options():
    model = ToyClassifier()

    def layout(**options):
        return resolve_wrapper(dict(type=MMFullyShard, **options)).layout(model)

    layout(auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlock']))
    with pytest.raises(ValueError, match="'ToyBlk'.*ToyBlock"):
        layout(auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlk']))
    with pytest.raises(ValueError, match='activation_checkpointing.layer_cls'):
        layout(activation_checkpointing=dict(layer_cls=['Blk']))


def test_registered_as_an_mmengine_model_wrapper():
    assert MMENGINE_MODEL_WRAPPERS.get('mmfsdp.MMFullyShard') is MMFullyShard
    wrapper = MMFullyShard.__new__(MMFullyShard)
    nn.Module.__init__(wrapper)
    assert is_model_wrapper(wrapper)


# ------------------------------------------------------------------ shared parameters

def _gpt() -> GPT:
    return GPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _units(model: nn.Module, cfg) -> list:
    return plan_units(model, build_wrap_policy(cfg, model))


def test_transformer_policy_needs_no_merge_for_the_tied_gpt():
    model = _gpt()
    units = _units(model, dict(type='transformer', layer_cls=['TransformerBlock']))
    assert merge_units_sharing_parameters(model, units) == (units, [])


def test_tied_embedding_unit_merges_into_the_root():
    model = _gpt()
    units = _units(model, dict(type='module_types', module_cls=['Embedding']))
    assert units == ['wte', 'wpe']
    kept, merges = merge_units_sharing_parameters(model, units)
    assert kept == ['wpe']
    assert len(merges) == 1 and merges[0].dropped == ('wte', ) and merges[0].owner == ROOT
    assert merges[0].parameter_names == ('wte.weight', 'lm_head.weight')


@pytest.mark.parametrize('config', [FSDPConfig, FullyShardConfig])
def test_no_two_units_share_a_parameter_under_either_sharded_wrapper(config):
    """FSDP1 keeps a parameter in one flat parameter as FSDP2 keeps it in one group: the
    GPT's size_based units once gave FSDP1 lm_head alone, whose forward then read a flat
    shard of the tied weight ('size mismatch, got input (16), mat (16x16), vec (2048)';
    found by the differential tier, seed 7044)."""
    model = _gpt()
    layout = config.from_dict(dict(auto_wrap_policy=dict(type='size_based',
                                                         min_num_params=300))).layout(model)
    owners = {name: max((u for u in layout.units if within(name, u)), key=len, default='')
              for name in ('wte', 'lm_head')}
    assert owners['wte'] == owners['lm_head']


def test_tied_units_both_merge_into_their_common_ancestor():
    model = _gpt()
    units = _units(model, dict(type='module_types', module_cls=['Embedding', 'Linear']))
    assert 'wte' in units and 'lm_head' in units
    kept, merges = merge_units_sharing_parameters(model, units)
    assert 'wte' not in kept and 'lm_head' not in kept and 'wpe' in kept
    assert 'blocks.0.attn.qkv' in kept  # untouched


def test_sharing_inside_a_unit_stays_in_that_unit():
    inner = nn.ModuleDict(dict(a=nn.Linear(4, 4), b=nn.Linear(4, 4)))
    inner.b.weight = inner.a.weight
    model = nn.ModuleDict(dict(outer=nn.ModuleDict(dict(inner=inner)), other=nn.Linear(4, 4)))
    kept, merges = merge_units_sharing_parameters(
        model, ['outer.inner.a', 'outer.inner.b', 'outer.inner', 'other'])
    assert kept == ['outer.inner', 'other']
    assert merges[0].owner == 'outer.inner'
    assert merges[0].dropped == ('outer.inner.a', 'outer.inner.b')


def test_shared_module_counts_as_shared_parameters():
    block = nn.Linear(4, 4)
    model = nn.Sequential(block, nn.ReLU(), block)
    kept, merges = merge_units_sharing_parameters(model, ['0', '2'])
    assert kept == [] and merges[0].owner == ROOT


def test_sharding_spec_describes_the_mesh_and_the_merged_units(monkeypatch):
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
    cfg = dict(auto_wrap_policy=dict(type='module_types', module_cls=['Embedding']),
               sharding_strategy='HYBRID_SHARD', mixed_precision=dict(param_dtype='bf16'))
    spec = _spec(cfg, 8)
    assert (spec.replicate_size, spec.shard_size) == (2, 4)
    assert spec.units == ('wpe', ) and spec.compute_dtype is torch.bfloat16
    assert not spec.keep_gathered_until_backward
    spec = _spec(dict(reshard_after_forward=False), 2)
    assert spec.shard_size == 2 and spec.units == () and spec.keep_gathered_until_backward


def _spec(options: dict, world_size: int):
    """The sharding of the GPT as the runner resolves it: config, layout, spec."""
    config = resolve_wrapper(dict(type=MMFullyShard, **options)).config
    return sharding_spec(config, config.layout(_gpt()), world_size)


def test_the_plan_keeps_a_group_share_of_each_unit_with_an_int_reshard_after_forward():
    from mmfsdp.plan import plan_for
    model = _gpt()

    def gathered(reshard) -> int:
        cfg = dict(auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
                   reshard_after_forward=reshard)
        return plan_for(MMFullyShard, cfg, model, 4).gathered_in_flight_bytes

    resharded, in_pairs, kept = gathered(True), gathered(2), gathered(False)
    print(f'gathered in flight: True {resharded}, 2 {in_pairs}, False {kept}')
    assert resharded < in_pairs < kept


def test_pinned_offload_on_a_cpu_only_machine_says_what_to_do():
    if torch.accelerator.current_accelerator() is not None:
        pytest.skip('this process trains on an accelerator')
    cpu = torch.device('cpu')  # what FSDPRunner checks at start-up, for its device
    FullyShardConfig.from_dict(dict(offload=dict(cpu_offload=True, pin_memory=False))
                               ).check_device(cpu)
    with pytest.raises(ValueError, match='offload.pin_memory: pinned memory needs an accelerator'):
        FullyShardConfig.from_dict(dict(offload=dict(cpu_offload=True))).check_device(cpu)


def test_fsdp1_no_shard_refuses_unsharded_bf16_accumulation_of_a_model_with_tied_weights():
    """torch's FSDP1 fails in the backward there ('attempting to assign a gradient with dtype
    BFloat16 to a tensor with grad_dtype Float'; found by the differential tier, seed
    29944778: the GPT, NO_SHARD, bf16, accumulate 2 unsharded); the toy, untied, trains."""
    cfg = dict(sharding_strategy='NO_SHARD', mixed_precision=dict(param_dtype='bf16'),
               accumulation='unsharded')
    with pytest.raises(ValueError, match="accumulation='unsharded' with sharding_strategy="
                                         "'NO_SHARD'.*shares wte.weight = lm_head.weight"):
        FSDPConfig.from_dict(cfg).layout(_gpt())
    FSDPConfig.from_dict(cfg).layout(ToyClassifier())
    FSDPConfig.from_dict(dict(cfg, accumulation='sharded')).layout(_gpt())
