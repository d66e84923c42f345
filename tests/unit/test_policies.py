"""Wrap policies: registry names, options, checks against the model, and the unit plan."""
import copy
import types

import pytest
from mmengine.logging import MMLogger
from torch import nn

from contract_models import AttentionClassifier
from mmfsdp import MMFullyShard
from mmfsdp.demo import GPT, TransformerBlock
from mmfsdp.plan import format_plan, log_sharding_plan, plan_for
from mmfsdp.policies import ModelIndex, build_wrap_policy, plan_units
from mmfsdp.registry import FSDP_WRAP_POLICIES
from mmfsdp.wrappers import FSDPConfig, FullyShardConfig
from mmfsdp.wrappers.builder import model_wrapper_config, resolve_wrapper
from toy import ToyBlock, ToyClassifier
from vision import BottleneckResNet, GroupNormNet, TinyViT


@pytest.fixture
def model():
    return ToyClassifier(dim=16, depth=3)


BLOCK_UNITS = ['blocks.0', 'blocks.1', 'blocks.2']


def _units(cfg, model):
    return plan_units(model, build_wrap_policy(cfg, model))


def test_transformer_policy_by_class_name(model):
    assert _units(dict(type='transformer', layer_cls=['ToyBlock']), model) == BLOCK_UNITS


def test_transformer_policy_by_class(model):
    assert _units(dict(type='transformer', layer_cls=[ToyBlock]), model) == BLOCK_UNITS


def test_a_name_alone_is_a_policy_without_options(model):
    with pytest.raises(TypeError, match="missing a required argument: 'layer_cls'"):
        build_wrap_policy('transformer', model)


def test_module_types_policy(model):
    units = _units(dict(type='module_types', module_cls=['LayerNorm']), model)
    assert units == ['blocks.0.norm', 'blocks.1.norm', 'blocks.2.norm', 'norm']


def test_size_based_policy_counts_parameters_not_yet_wrapped(model):
    # a block holds 1072 parameters; the root's remainder is not a unit
    assert _units(dict(type='size_based', min_num_params=1000), model) == BLOCK_UNITS
    assert _units(dict(type='size_based', min_num_params=100), model) == [
        'embed', 'blocks.0.fc1', 'blocks.0.fc2', 'blocks.1.fc1', 'blocks.1.fc2', 'blocks.2.fc1',
        'blocks.2.fc2']


def test_size_based_never_wraps_a_module_list_itself():
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 2))
    units = _units(dict(type='size_based', min_num_params=10), model)
    assert units == ['0.0', '0.1', '0.2', '1']


def test_list_of_policies_wraps_if_any_says_so(model):
    cfg = [dict(type='transformer', layer_cls=['ToyBlock']),
           dict(type='module_types', module_cls=['Linear'])]
    assert 'embed' in _units(cfg, model) and 'blocks.0' in _units(cfg, model)


def test_plain_callable_is_a_policy(model):

    def head_only(module, recurse, nonwrapped_numel):
        return recurse or module is model.head

    assert _units(head_only, model) == ['head']


def test_user_registered_policy_takes_options_from_the_config(model):

    @FSDP_WRAP_POLICIES.register_module(force=True)
    def big_linears(module, recurse, nonwrapped_numel, min_params=1000):
        return recurse or (isinstance(module, nn.Linear) and nonwrapped_numel >= min_params)

    assert _units(dict(type='big_linears', min_params=500), model) == [
        'blocks.0.fc1', 'blocks.0.fc2', 'blocks.1.fc1', 'blocks.1.fc2', 'blocks.2.fc1',
        'blocks.2.fc2']
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'min_param'.*min_params"):
        build_wrap_policy(dict(type='big_linears', min_param=5), model)


def test_unknown_policy_name_lists_registered_names(model):
    with pytest.raises(KeyError) as e:
        build_wrap_policy(dict(type='transfomer', layer_cls=['ToyBlock']), model)
    msg = str(e.value)
    assert 'auto_wrap_policy.type' in msg and "'transfomer'" in msg
    assert "did you mean 'transformer'" in msg and 'size_based' in msg


def test_class_name_absent_from_model_lists_close_matches(model):
    with pytest.raises(ValueError) as e:
        build_wrap_policy(dict(type='transformer', layer_cls=['ToyBlok']), model)
    msg = str(e.value)
    assert 'auto_wrap_policy.layer_cls' in msg and "'ToyBlok'" in msg and 'ToyBlock' in msg


@pytest.mark.parametrize('value', [0, -5, 1.5, True])
def test_size_based_needs_a_positive_parameter_count(model, value):
    with pytest.raises(ValueError, match='min_num_params'):
        build_wrap_policy(dict(type='size_based', min_num_params=value), model)


@pytest.mark.parametrize('config', [FSDPConfig, FullyShardConfig])
def test_a_policy_that_wraps_nothing_is_an_error(model, config):
    for policy in (dict(type='size_based', min_num_params=10**9),
                   dict(type='module_types', module_cls=[nn.Conv2d])):
        with pytest.raises(ValueError, match='makes no unit of any submodule'):
            config.from_dict(dict(auto_wrap_policy=policy)).layout(model)


def test_none_means_one_unit_for_the_whole_model(model):
    assert build_wrap_policy(None, model) is None


def test_building_a_policy_leaves_the_config_unchanged(model):
    cfg = [dict(type='transformer', layer_cls=['ToyBlock']),
           dict(type='size_based', min_num_params=100)]
    before = copy.deepcopy(cfg)
    build_wrap_policy(cfg, model)
    build_wrap_policy(cfg, model)
    assert cfg == before


def test_builtin_policies_are_registered():
    assert {'size_based', 'transformer', 'module_types', 'auto'} <= set(
        FSDP_WRAP_POLICIES.module_dict)


# 'auto': the model's repeated blocks (ModelIndex.repeated_blocks)


def _auto(model):
    """The classes 'auto' chooses (by name) and the units it makes."""
    index = ModelIndex(model)
    return [c.__name__ for c in index.repeated_blocks], _units('auto', index)


def test_auto_chooses_the_demo_gpts_transformer_blocks_not_their_mlps_or_linears():
    assert _auto(GPT(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)) == (
        ['TransformerBlock'], ['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3'])


def test_auto_chooses_a_vits_encoder_layers():
    assert _auto(TinyViT(depth=3)) == (['EncoderLayer'], ['layers.0', 'layers.1', 'layers.2'])


def test_auto_chooses_bottlenecks_not_the_stages_that_hold_them():
    # ResLayer (a Sequential of Bottlenecks) repeats too, but each holds several blocks: a
    # stage. The downsample Sequentials sit inside Bottlenecks, the stem is one Sequential.
    model = BottleneckResNet(depths=(2, 3, 2, 2))
    classes, units = _auto(model)
    assert classes == ['Bottleneck']
    assert units == [f'stages.{s}.{b}' for s, n in enumerate((2, 3, 2, 2)) for b in range(n)]
    # the last stage (two blocks, the first widening) is below 2x its largest block: a rule
    # on size alone would have taken the stages, as for ResNet-18
    index = ModelIndex(model)
    last = [sum(index.below[f'stages.3.{b}'].values()) for b in range(2)]
    assert sum(index.below['stages.3'].values()) < 2 * max(last)


class _Layer(nn.Module):
    """A decoder layer with two attentions (a third of it): a block, not a stage."""

    def __init__(self, dim=8):
        super().__init__()
        self.self_attn, self.cross_attn = ToyBlock(dim), ToyBlock(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 8 * dim), nn.Linear(8 * dim, dim))


class _Stage(nn.Module):
    """Two layers and a small projection: a stage (its layers hold most of it)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.proj = nn.Linear(8, 8)


def test_auto_nested_repetition_takes_the_outermost_class_that_is_not_a_stage():
    model = nn.Sequential(_Stage(), _Stage(), nn.Linear(8, 8))
    assert _auto(model) == (['_Layer'], ['0.layers.0', '0.layers.1', '1.layers.0', '1.layers.1'])


def test_auto_with_nothing_repeated_is_one_unit_and_says_so(caplog):
    logger = MMLogger.get_current_instance()
    logger.addHandler(caplog.handler)
    try:
        layout = FullyShardConfig.from_dict(dict(auto_wrap_policy='auto')).layout(GroupNormNet())
    finally:
        logger.removeHandler(caplog.handler)
    assert layout.units == () and layout.policy is None
    assert "auto_wrap_policy='auto': GroupNormNet has no repeated block" in caplog.text


@pytest.mark.parametrize('config', [FSDPConfig, FullyShardConfig])
def test_auto_in_one_word_for_units_and_checkpointing_equals_the_hand_written_list(config):
    model = GPT(vocab_size=256, block_size=16, n_layer=3, n_head=2, n_embd=32)
    auto = config.from_dict(dict(auto_wrap_policy='auto',
                                 activation_checkpointing=dict(layer_cls='auto'))).layout(model)
    hand = config.from_dict(dict(auto_wrap_policy=dict(type='transformer',
                                                       layer_cls=['TransformerBlock']),
                                 activation_checkpointing=dict(layer_cls=['TransformerBlock']))
                            ).layout(model)
    assert auto.units == hand.units == ('blocks.0', 'blocks.1', 'blocks.2')
    assert auto.checkpoint_layers == hand.checkpoint_layers == (TransformerBlock, )
    assert _units(dict(type='auto'), model) == list(hand.units)


def test_the_plan_log_says_which_classes_auto_chose_and_their_share():
    model = GPT(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)
    lines = []
    log_sharding_plan(types.SimpleNamespace(info=lines.append, warning=lines.append),
                      plan_for(MMFullyShard, dict(auto_wrap_policy='auto'), model, 2))
    assert "auto_wrap_policy='auto' chose the repeated blocks: 4 x TransformerBlock (85% of " \
           'the parameters)' in lines[0]
    hand = format_plan(plan_for(MMFullyShard, dict(auto_wrap_policy=dict(
        type='transformer', layer_cls=['TransformerBlock'])), model, 2))
    assert 'units: 4 x TransformerBlock (85% of the parameters)' in hand


class _LoraLinear(nn.Module):
    """peft's LoRA ``Linear`` in shape: the frozen layer as ``base_layer``, two small adapters."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({'default': nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({'default': nn.Linear(rank, base.out_features, bias=False)})


def _tiny_llama(lora: bool) -> nn.Module:
    transformers = pytest.importorskip('transformers', reason='pip install -e .[tests]')
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2))
    if lora:  # every Linear of the decoder layers, as XTuner's find_all_linear_names targets
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, _LoraLinear(child))
    return model


@pytest.mark.parametrize('lora', [False, True], ids=['full', 'lora'])
def test_auto_chooses_the_decoder_layers_a_transformers_model_declares(lora):
    model = _tiny_llama(lora)
    index = ModelIndex(model)
    if lora:  # by structure alone the decoder layers look like stages of LoRA Linears
        assert [c.__name__ for c in index.repeated_blocks] == ['_LoraLinear']
    blocks, why = index.auto_blocks
    assert [c.__name__ for c in blocks] == ['LlamaDecoderLayer']
    assert why == 'the blocks LlamaForCausalLM declares (_no_split_modules)'
    hand = dict(type='transformer', layer_cls=['LlamaDecoderLayer'])
    assert _units('auto', model) == _units(hand, model) == [f'model.layers.{i}' for i in range(3)]
    declared = "auto_wrap_policy='auto' chose the blocks LlamaForCausalLM declares " \
        '(_no_split_modules)'
    plan = format_plan(plan_for(MMFullyShard, dict(auto_wrap_policy='auto'), model, 8))
    assert f'{declared}: 3 x LlamaDecoderLayer' in plan
    assert plan.replace(declared, 'units') == format_plan(
        plan_for(MMFullyShard, dict(auto_wrap_policy=hand), model, 8))


# nn.MultiheadAttention reads out_proj.weight without calling out_proj: never split


@pytest.mark.parametrize('policy, units', [
    (dict(type='size_based', min_num_params=200), [
        'blocks.0.fc1', 'blocks.0.fc2', 'blocks.1.fc1', 'blocks.1.fc2', 'blocks.2.fc1',
        'blocks.2.fc2', 'attn']),
    (dict(type='module_types', module_cls=['Linear']), [
        'embed', 'blocks.0.fc1', 'blocks.0.fc2', 'blocks.1.fc1', 'blocks.1.fc2', 'blocks.2.fc1',
        'blocks.2.fc2', 'head']),
])
def test_no_policy_makes_a_unit_inside_multihead_attention(policy, units):
    """Before: 'attn.out_proj' was a unit (size_based: 272 parameters; a Linear subclass)."""
    assert _units(policy, AttentionClassifier(dim=16, depth=3)) == units


def test_torch_size_based_policy_by_dotted_name_keeps_multihead_attention_whole():
    """mmengine's strategy configs name torch's policy; it never recurses into attention."""
    strategy = dict(type='FSDPStrategy', model_wrapper=dict(auto_wrap_policy=dict(
        type='torch.distributed.fsdp.wrap.size_based_auto_wrap_policy', min_num_params=200)))
    wrapping = resolve_wrapper(model_wrapper_config(dict(strategy=strategy)))
    layout = wrapping.layout(AttentionClassifier(dim=16, depth=3))
    assert 'attn.out_proj' not in layout.units and 'attn' in layout.units
