"""The sharding plan's arithmetic on meta-device models: every parameter once, shards shrinking
with the world size, warnings for plans that do not shard.
"""
import json

import pytest
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


def test_the_plan_names_the_dtype_each_units_gradients_are_reduced_in():
    """An unset ``reduce_dtype`` is ``param_dtype`` (resolved, so on every torch); the modules
    kept in fp32 reduce in fp32; frozen units reduce nothing."""
    from mmfsdp.wrappers import MMFullyShard
    blocks = dict(type='transformer', layer_cls=['ToyBlock'])
    bf16 = dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=blocks,
                mixed_precision=dict(param_dtype='bf16', fp32_modules=['LayerNorm']))
    plan = plan_for(MMFullyShard, bf16, meta_toy(), 2, ADAMW)
    assert {u.name: u.reduce_dtype for u in plan.units} == {
        '': torch.bfloat16, 'norm': torch.float32,
        **{f'blocks.{i}': torch.bfloat16 for i in range(3)},
        **{f'blocks.{i}.norm': torch.float32 for i in range(3)}}
    assert 'gradients reduced (reduce-scatter) in bfloat16 ((root), blocks.0, blocks.1, ' \
        'blocks.2); float32 (blocks.0.norm, blocks.1.norm, blocks.2.norm, norm)' \
        in format_plan(plan)
    assert plan_to_dict(plan)['units'][-1]['reduce_dtype'] == 'float32'
    fp32 = plan_for(MMFullyShard, dict(bf16, mixed_precision=dict(param_dtype='bf16',
                                                                reduce_dtype='fp32')),
                    meta_toy(), 2, ADAMW)
    assert 'gradients reduced (reduce-scatter) in float32 (every unit)' in format_plan(fp32)


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



def test_a_root_larger_than_every_block_is_gathered_once():
    # RetinaNet's shape: the FPN and the head stay in the root, larger than any backbone block;
    # two units are gathered at once (computing, prefetched), not the root twice
    from mmfsdp.wrappers import MMFullyShard
    from toy import ToyClassifier
    with torch.device('meta'):
        model = ToyClassifier(dim=16, depth=2)
        model.head = nn.Linear(16, 4096)
    wrapper = dict(type='mmfsdp.MMFullyShard',
                   auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlock']))
    plan = plan_for(MMFullyShard, wrapper, model, 2, ADAMW)
    root, block = plan.root, plan.units[-1]
    assert root.gathered_bytes > 10 * block.gathered_bytes
    assert plan.gathered_in_flight_bytes == (root.gathered_bytes + block.gathered_bytes
                                             + root.reduced_bytes)

# ---- the CLI resolves the config as FSDPRunner does ----------------------------------------


def _cli_plans(tmp_path, capsys, wrapper_cfg: dict, *args: str) -> list:
    """``python -m mmfsdp.plan`` on a toy config with ``wrapper_cfg``, in this process."""
    import json

    from mmfsdp.plan.__main__ import main
    config = tmp_path / 'toy_config.py'
    config.write_text(f'model = dict(type="ToyClassifier")\nmodel_wrapper_cfg = {wrapper_cfg!r}\n'
                      'optim_wrapper = dict(optimizer=dict(type="AdamW", lr=1e-3))\n')
    capsys.readouterr()
    main([str(config), '--world-size', '1', '8', '64', '--format', 'json', *args])
    return json.loads(capsys.readouterr().out)


def test_the_cli_plans_a_wrapper_config_without_type_as_the_runner_trains_it(tmp_path, capsys):
    # no 'type': the keys are options of the default wrapper (mmengine's rule), DDP
    plans = _cli_plans(tmp_path, capsys, dict(find_unused_parameters=True), '--no-trace')
    assert [p['world_size'] for p in plans] == [1, 8, 64]
    assert {p['wrapper'] for p in plans} == {'mmfsdp.MMDistributedDataParallel'}


def test_the_cli_resolves_once_and_lays_out_once_for_every_world_size(tmp_path, capsys,
                                                                     monkeypatch):
    import collections

    from mmfsdp.registry import FSDP_WRAP_POLICIES
    from mmfsdp.wrappers import FullyShardConfig
    from toy import ToyBlock, ToyClassifier
    counts: collections.Counter = collections.Counter()
    real = FullyShardConfig.from_dict.__func__

    def counting(cls, cfg):
        counts['resolutions'] += 1
        return real(cls, cfg)

    @FSDP_WRAP_POLICIES.register_module(name='counting_toy_blocks', force=True)
    def counting_toy_blocks(module, recurse, nonwrapped_numel):
        counts['layouts'] += isinstance(module, ToyClassifier) and recurse
        return recurse or isinstance(module, ToyBlock)

    monkeypatch.setattr(FullyShardConfig, 'from_dict', classmethod(counting))
    plans = _cli_plans(tmp_path, capsys, dict(type='mmfsdp.MMFullyShard',
                                              auto_wrap_policy=dict(type='counting_toy_blocks')),
                       '--input-shape', '4,6')
    assert [p['world_size'] for p in plans] == [1, 8, 64]
    assert all(p['step'] is not None for p in plans)  # the trace used the same layout
    assert dict(counts) == dict(resolutions=1, layouts=1)


# ---- detectors and segmenters as mmdet and mmseg build them -----------------------------------

from mmengine.model import BaseModel  # noqa: E402
from mmengine.registry import DATASETS, MODELS  # noqa: E402


@MODELS.register_module(name='PlanTestSegmentor', force=True)
class Segmentor(BaseModel):
    """mmseg's shape: a backbone whose stem is frozen and whose norms stay in eval mode, and a
    decode head whose loss stacks the label maps and drops ignored pixels by a boolean mask."""

    def __init__(self, data_preprocessor=None, fail=''):
        super().__init__(data_preprocessor=data_preprocessor)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.decode_head = nn.Conv2d(8, 3, 1)
        self.stem.requires_grad_(False)
        self.fail = fail

    def train(self, mode=True):
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.decode_head(self.block(self.stem(inputs)))
        if mode != 'loss':
            return logits
        if self.fail:
            raise ValueError(self.fail)
        labels = torch.stack(data_samples)
        valid = labels != 255
        return dict(loss_seg=nn.functional.cross_entropy(logits.permute(0, 2, 3, 1)[valid],
                                                         labels[valid]))


@DATASETS.register_module(name='PlanTestSegments', force=True)
class Segments(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        labels = torch.zeros(16, 16, dtype=torch.long)
        labels[:4] = 255
        return dict(inputs=torch.zeros(3, 16, 16, dtype=torch.uint8), data_samples=labels)


def _segmentor_config(tmp_path, **model):
    config = tmp_path / 'segmentor.py'
    config.write_text(
        f'model = dict(type="PlanTestSegmentor", **{model!r})\n'
        'data_preprocessor = dict(type="ImgDataPreprocessor", mean=[0, 0, 0], std=[1, 1, 1])\n'
        'train_dataloader = dict(batch_size=2, dataset=dict(type="PlanTestSegments"), '
        'collate_fn=dict(type="pseudo_collate"))\n'
        'model_wrapper_cfg = dict(type="mmfsdp.MMFullyShard")\n'
        'optim_wrapper = dict(optimizer=dict(type="AdamW", lr=1e-3))\n')
    return str(config)


def test_fit_memory_answers_for_a_frozen_segmentor_with_a_masked_loss(tmp_path, capsys):
    from mmfsdp.plan.__main__ import main
    capsys.readouterr()
    main([_segmentor_config(tmp_path), '--world-size', '1', '2', '--fit-memory', '1GiB'])
    out = capsys.readouterr().out
    assert 'smallest that fits: 1 ranks, DDP' in out
    main([_segmentor_config(tmp_path), '--world-size', '2'])
    out = capsys.readouterr().out
    # the model's own forward reads the mask: it ran on real tensors, and the plan says so
    assert ('measured on real CPU tensors, not traced (the code needs tensor values; random '
            "weights, the batch's own targets): (root).forward (DynamicOutputShapeException: "
            'aten.nonzero.default at tests/unit/test_plan.py:') in out
    assert 'batch: one sample of train_dataloader.dataset, repeated' in out


def test_a_model_that_fails_is_named_not_the_dataset(tmp_path, capsys):
    from mmfsdp.plan.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main([_segmentor_config(tmp_path, fail='anchors outside the image'), '--fit-memory',
              '1GiB'])
    message = str(exit_.value)
    assert 'ValueError: anchors outside the image at tests/unit/test_plan.py:' in message, message
    assert 'dataset' not in message
    assert '(root).forward cannot be traced (ValueError' in message
    # where the batch cannot be made, the dataset hint stays
    config = _segmentor_config(tmp_path)
    with open(config, 'a') as f:
        f.write('train_dataloader.update(dataset=dict(type="CocoDataset"))\n')
    main([config, '--world-size', '2'])
    out = capsys.readouterr().out
    assert 'activations not traced: KeyError' in out
    assert 'where the training dataset is not on this machine' in out


def test_fit_memory_checkpoints_the_repeated_blocks_where_nothing_names_layers(tmp_path, capsys):
    # a config as a detector's user writes it: no wrap policy, no activation_checkpointing; the
    # activations dominate, so no wrapper option fits the budget without checkpointing
    args = ['--world-size', '1', '2', '--input-shape', '8192,6', '--fit-memory']
    found = _cli_plans(tmp_path, capsys, {}, *args, '1TiB')
    off = min(c['peak_bytes'] for c in found if not c['activation_checkpointing'])
    on = [c for c in found if c['activation_checkpointing']]
    assert on and all(c['model_wrapper_cfg']['activation_checkpointing'] == dict(
        layer_cls=['ToyBlock']) for c in on)
    budget = (off + min(c['peak_bytes'] for c in on)) // 2
    assert max(c['peak_bytes'] for c in on if c['world_size'] == 1) < budget
    from mmfsdp.plan.__main__ import main
    main([str(tmp_path / 'toy_config.py'), *args, str(budget)])
    out = capsys.readouterr().out
    assert 'smallest that fits: 1 ranks, DDP, activation checkpointing on' in out, out
    assert "AC on checkpoints ToyBlock (the model's repeated blocks, layer_cls='auto')" in out


class Queries(nn.Module):
    """mmdet's ``CdnQueryGenerator``: called through its own ``__call__``, which Python looks up
    on the type, so the method calling it is the part."""

    def __call__(self, inputs):
        return self.noisy(inputs)

    def noisy(self, inputs):
        return torch.nonzero(inputs.flatten() >= 0).float().mean()


@MODELS.register_module(name='PlanTestDetr', force=True)
class Detr(Segmentor):
    """DETR's shape: a method of the model itself, between the backbone and the transformer,
    reads the feature map's shape as a tensor (mmdet's ``DeformableDETR.pre_transformer``)."""

    def __init__(self, data_preprocessor=None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.queries = Queries()

    def pre_transformer(self, feats):
        shape = torch._shape_as_tensor(feats)[2:]
        return feats.flatten(2)[..., :int(shape.prod())]

    def pre_decoder(self, tokens, inputs):
        return tokens + self.queries(inputs)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        tokens = self.pre_decoder(self.pre_transformer(self.block(self.stem(inputs))), inputs)
        return dict(loss=self.decode_head(tokens[..., None]).mean()) if mode == 'loss' else tokens


def test_a_method_of_the_model_runs_on_real_tensors_not_its_whole_forward(tmp_path, capsys):
    from mmfsdp.plan.__main__ import main
    config = tmp_path / 'detr.py'
    config.write_text(open(_segmentor_config(tmp_path)).read().replace('Segmentor', 'Detr'))
    capsys.readouterr()
    main([str(config), '--world-size', '2'])
    out = capsys.readouterr().out
    # the backbone stays traced: only the method that reads values runs on real tensors
    assert ("(root).pre_transformer (RuntimeError: The tensor has a non-zero number of elements"
            in out), out
    assert '(root).pre_decoder (DynamicOutputShapeException: aten.nonzero.default' in out
    assert '(root).forward' not in out


@pytest.mark.parametrize('optim_wrapper', [
    dict(type='AmpOptimWrapper', dtype='bfloat16'),  # mmengine's
    dict(type='mmfsdp.AmpOptimWrapper', dtype='bf16'),
    dict(type='AmpOptimWrapper', loss_scale='dynamic')])  # tools/train.py --amp: float16
def test_an_amp_optim_wrapper_traces_the_forward_under_autocast(tmp_path, capsys, optim_wrapper):
    # the parameters stay fp32; the activations take the autocast dtype: about half
    def step(optim):
        config = tmp_path / 'amp_config.py'
        config.write_text('model = dict(type="ToyClassifier", dim=64)\n'
                          'model_wrapper_cfg = dict(type="mmfsdp.MMFullyShard")\n'
                          f'optim_wrapper = dict({optim!r}, optimizer=dict(type="AdamW"))\n')
        from mmfsdp.plan.__main__ import main
        main([str(config), '--world-size', '2', '--input-shape', '8192,6', '--format', 'json'])
        return json.loads(capsys.readouterr().out)[0]
    capsys.readouterr()
    fp32, amp = step({}), step(optim_wrapper)
    ratio = amp['step']['activation_bytes'] / fp32['step']['activation_bytes']
    assert 0.45 < ratio < 0.6, ratio
    assert amp['step']['model_state_bytes'] == fp32['step']['model_state_bytes']
    assert amp['step']['compute_dtype'] == 'float32'
    low = 'float16' if optim_wrapper.get('dtype') is None else 'bfloat16'
    assert (fp32['step']['autocast_dtype'], amp['step']['autocast_dtype']) == (None, low)


class FreezesInTrain(nn.Module):
    """A backbone that freezes its stem in ``train()``, as mmdet's ResNet ``_freeze_stages``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(512, 512)
        self.head = nn.Linear(512, 512)

    def train(self, mode: bool = True) -> 'FreezesInTrain':
        super().train(mode)
        self.stem.requires_grad_(False)
        return self


def test_parameters_frozen_in_train_get_no_gradient_and_no_optimizer_state():
    """mmengine calls ``model.train()`` before the first step. Before: the stem, trainable when
    the plan read it, was planned with gradients and AdamW state (2.0 and 4.0 MiB where 1.0
    and 2.0 MiB are held, at one rank)."""
    frozen_at_build = FreezesInTrain()
    frozen_at_build.stem.requires_grad_(False)
    model = FreezesInTrain()  # built: every parameter trainable
    model.head.training = False
    linears = dict(type=FSDP, auto_wrap_policy=dict(type='module_types', module_cls=['Linear']))
    plans = [plan_for(MMFullyShardedDataParallel, linears, m, 1, ADAMW)
             for m in (model, frozen_at_build)]
    grads, states = ([sum(getattr(u, key) for u in p.units) for p in plans]
                     for key in ('grad_bytes', 'optimizer_bytes'))
    print(f'gradients {grads}, optimizer state {states} (bytes)')
    assert grads[0] == grads[1] == 4 * (512 * 512 + 512)
    assert states[0] == states[1] == 2 * grads[1]
    # the plan leaves the model as it found it
    assert [m.training for m in model.modules()] == [True, True, False]
    assert all(p.requires_grad for p in model.parameters())
