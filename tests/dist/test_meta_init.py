"""Meta init builds what eager construction builds, or fails naming what it cannot.

One 2-rank process group runs every distributed check (starting interpreters is
the cost): a model with a bare ``nn.Parameter``, an ``nn.MultiheadAttention``,
an ``arange`` buffer, a LayerScale and a ``cls_token`` under FSDP2 and FSDP1
meta init against eager construction, with and without ``load_from``; a tensor
nothing writes; ``init_cfg=Pretrained`` with a prefix; an ``init_cfg`` type
that cannot work on shards; a backbone that loads its own Pretrained file in
``init_weights`` (as mmdet's Swin does), after init and after training; and
Hugging Face's ``GPT2LMHeadModel`` (tied embeddings) under meta init +
``load_from``. Single-process tests cover the construction itself and the plan CLI.
"""
import copy
import os

import pytest
import torch
from mmengine.config import Config
from mmengine.model import BaseModel, BaseModule
from mmengine.registry import MODELS
from mmengine.runner import CheckpointLoader
from torch import nn

from harness import max_abs_diff, run_distributed
from toy import IN_DIM, NUM_CLASSES, runner_config

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

FS = 'mmfsdp.MMFullyShard'
FSDP1 = 'mmfsdp.MMFullyShardedDataParallel'
DIM = 8
WRAPPERS = {
    'fsdp2': dict(type=FS, auto_wrap_policy=dict(type='transformer', layer_cls=['ZooBlock'])),
    'fsdp1': dict(type=FSDP1, auto_wrap_policy=dict(type='transformer', layer_cls=['ZooBlock'])),
}


class LayerScale(nn.Module):
    """A constant set by the constructor and by nothing else."""

    def __init__(self, dim: int, value: float = 1e-2) -> None:
        super().__init__()
        self.gamma = nn.Parameter(value * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ZooBlock(nn.Module):
    """Attention (initialised in ``_reset_parameters``) and a LayerScale."""

    def __init__(self, dim: int, drop: float) -> None:
        super().__init__()
        self.drop = drop
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ls = LayerScale(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.ls(self.attn(h, h, h, need_weights=False)[0])


@MODELS.register_module()
class MetaZoo(BaseModel):
    """What real backbones do in their constructors.

    ``init='deterministic'`` writes every randomly initialised weight with a
    constant in ``init_weights`` (so meta init must equal eager exactly);
    ``unset=True`` adds a parameter that only a checkpoint can provide. A
    ``data_preprocessor`` without ``type`` gets one, as mmpretrain's classifiers do.
    """

    def __init__(self, depth: int = 2, init: str = 'deterministic', unset: bool = False,
                 data_preprocessor=None, init_cfg=None) -> None:
        if isinstance(data_preprocessor, dict):
            data_preprocessor = {'type': 'ImgDataPreprocessor', **data_preprocessor}
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        # the OpenMMLab idiom: fails under a global torch.device('meta')
        self.rates = [r.item() for r in torch.linspace(0, 0.1, depth)]
        self.init = init
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.bias = nn.Parameter(torch.full((DIM, ), 0.5))  # bare, constructor-set
        self.register_buffer('position_ids', torch.arange(5), persistent=False)
        self.register_buffer('steps', torch.tensor([3, 1, 4], dtype=torch.int64))
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(ZooBlock(DIM, r) for r in self.rates)
        self.head = nn.Linear(DIM, 3)
        if unset:
            self.unset = nn.Parameter(torch.empty(DIM))

    def init_weights(self) -> None:
        super().init_weights()
        if self.init != 'deterministic':
            return
        for i, module in enumerate(self.modules()):
            if isinstance(module, nn.Linear):
                nn.init.constant_(module.weight, 0.01 * i)
                nn.init.constant_(module.bias, -0.1)
            elif isinstance(module, nn.MultiheadAttention):
                nn.init.constant_(module.in_proj_weight, -0.02 * i)

    def forward(self, inputs: torch.Tensor, data_samples=None, mode: str = 'tensor'):
        x = self.embed(inputs)[:, None] + self.cls_token + self.bias
        for block in self.blocks:
            x = block(x)
        logits = self.head(x[:, 0])
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits, data_samples))
        return logits


@MODELS.register_module()
class ZooBackbone(BaseModule):
    """A backbone initialised from a pretrained checkpoint through ``init_cfg``."""

    def __init__(self, init_cfg=None) -> None:
        super().__init__(init_cfg=init_cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.blocks = nn.ModuleList(ZooBlock(DIM, 0.0) for _ in range(2))


@MODELS.register_module()
class PretrainedZoo(BaseModel):
    """``backbone`` from ``init_cfg=Pretrained``; every Linear by a constant ``init_cfg``.

    mmengine applies the model's own ``init_cfg`` first, then the backbone's
    Pretrained: the backbone's Linear layers end pretrained, the head constant.
    """

    def __init__(self, checkpoint: str = '', init_type: str = 'Pretrained',
                 data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor,
                         init_cfg=dict(type='Constant', val=0.25, layer='Linear'))
        cfg = (dict(type='Pretrained', checkpoint=checkpoint, prefix='backbone',
                    map_location='cpu') if init_type == 'Pretrained' else dict(type=init_type))
        self.backbone = ZooBackbone(init_cfg=cfg)
        self.head = nn.Linear(DIM, 3)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        return self.head(inputs)


@MODELS.register_module()
class SelfLoadingBackbone(BaseModule):
    """Loads its ``init_cfg`` Pretrained file in its own ``init_weights``, as mmdet's Swin does.

    The file's ``table`` is interpolated to this model's length, read from
    ``self.state_dict()``, then ``self.load_state_dict``; ``pos_embed`` has one
    row, so one of two ranks holds an empty shard of it.
    """

    def __init__(self, table_len: int = 4, init_cfg=None) -> None:
        super().__init__(init_cfg=init_cfg)
        self.pos_embed = nn.Parameter(torch.zeros(1, 1, DIM))
        self.table = nn.Parameter(torch.zeros(table_len, 2))
        self.blocks = nn.ModuleList(ZooBlock(DIM, 0.0) for _ in range(2))

    def init_weights(self) -> None:
        ckpt = CheckpointLoader.load_checkpoint(self.init_cfg['checkpoint'], map_location='cpu')
        state = {k[9:]: v for k, v in ckpt['state_dict'].items() if k.startswith('backbone.')}
        size = self.state_dict()['table'].shape[0]
        state['table'] = nn.functional.interpolate(state['table'].T[None], size=size,
                                                   mode='linear')[0].T
        self.load_state_dict(state, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, None] + self.pos_embed + self.table.mean()
        for block in self.blocks:
            x = block(x)
        return x[:, 0]


@MODELS.register_module()
class SelfLoadingZoo(BaseModel):
    """A :class:`SelfLoadingBackbone` between Linear layers a constant ``init_cfg`` sets."""

    def __init__(self, checkpoint: str = '', data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor,
                         init_cfg=dict(type='Constant', val=0.25, layer='Linear'))
        self.embed = nn.Linear(IN_DIM, DIM)
        self.backbone = SelfLoadingBackbone(init_cfg=dict(type='Pretrained',
                                                          checkpoint=checkpoint))
        self.head = nn.Linear(DIM, NUM_CLASSES)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.head(self.backbone(self.embed(inputs)))
        if mode == 'loss':
            return dict(loss=nn.functional.cross_entropy(logits, data_samples))
        return logits


@MODELS.register_module()
class TinyGPT2(BaseModel):
    """Hugging Face's GPT-2 LM head model (tied embeddings) from a tiny config."""

    def __init__(self, data_preprocessor=None) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel
        super().__init__(data_preprocessor=data_preprocessor)
        self.gpt = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16,
                                              n_layer=2, n_head=2))

    def forward(self, inputs, data_samples=None, mode='tensor'):
        return self.gpt(inputs).logits


# ---------------------------------------------------------------- in the process group

def _runner(name: str, root: str, model: dict, wrapper: dict, **extra):
    from mmfsdp import FSDPRunner
    cfg = runner_config(name, f'{root}/{name}', batch_size=2, wrapper=copy.deepcopy(wrapper),
                        max_iters=0)
    cfg['model'] = copy.deepcopy(model)
    cfg['train_dataloader']['dataset'] = dict(type='ToyDataset', length=8)
    cfg.update(extra)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()  # zero iterations: build, wrap, initialise, load
    return runner


def _full(runner) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    state = gather_full_state(runner.model, None)[0]
    buffers = {n: b.detach().cpu().clone() for n, b in runner.model.module.named_buffers()}
    return dict(state={k: v.detach().cpu().clone() for k, v in state.items()}, buffers=buffers)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test compares the messages)
        return f'{type(e).__name__}: {e}'
    return 'no error'


def _full_or_error(*args, **kwargs):
    """:func:`_full` of ``_runner(*args, **kwargs)``, or the error it raised."""
    try:
        return _full(_runner(*args, **kwargs))
    except Exception as e:  # noqa: BLE001  (the test shows the error)
        return f'{type(e).__name__}: {e}'


def _save_rank0(obj, path: str) -> None:
    if torch.distributed.get_rank() == 0:
        torch.save(obj, path)
    torch.distributed.barrier()


def _two_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401  (registers the 'mmfsdp.' names)
    from mmfsdp import MMFullyShard
    from mmfsdp.meta_init import build_on_meta
    out = {}
    zoo = dict(type='MetaZoo')
    for wrapper in WRAPPERS:
        # deterministic init: meta init equals eager construction
        for init_device in (None, 'meta'):
            runner = _runner(f'{wrapper}-{init_device}', root, zoo,
                             dict(WRAPPERS[wrapper], init_device=init_device))
            out[f'{wrapper}/{init_device}'] = _full(runner)
            out[f'{wrapper}/{init_device}/preprocessor device'] = str(
                runner.model.module.data_preprocessor.device)
    # a tensor nothing writes: the same error on every rank
    unset = dict(type='MetaZoo', unset=True, init='random')
    out['unset error'] = _error(lambda: _runner(
        'unset', root, unset, dict(WRAPPERS['fsdp2'], init_device='meta')))
    # ... unless load_from provides it: random init, then a checkpoint of an eager build
    torch.manual_seed(123)
    eager = MODELS.build(unset)
    # The checkpoint is what provides `unset`, so it must hold values: torch.empty's memory
    # may be a freed block of the failed run above, still holding its NaN sentinel.
    nn.init.normal_(eager.unset)
    ckpt = os.path.join(root, 'zoo.pth')
    _save_rank0(dict(state_dict=eager.state_dict()), ckpt)
    for wrapper in WRAPPERS:
        for init_device in (None, 'meta'):
            runner = _runner(f'{wrapper}-{init_device}-load', root, unset,
                             dict(WRAPPERS[wrapper], init_device=init_device), load_from=ckpt)
            out[f'{wrapper}/{init_device}/load_from'] = _full(runner)

    # init_cfg=Pretrained under meta init: the shards are the pretrained weights
    torch.manual_seed(7)
    pretrained = MODELS.build(dict(type='ZooBackbone')).state_dict()
    pretrained = {f'backbone.{k}': v.normal_() for k, v in pretrained.items()}
    pretrained['neck.weight'] = torch.ones(2)  # another part of a bigger model
    weights = os.path.join(root, 'pretrained.pth')
    _save_rank0(dict(state_dict=pretrained), weights)
    out['pretrained'] = {k: v.clone() for k, v in pretrained.items()}
    model = dict(type='PretrainedZoo', checkpoint=weights)
    for wrapper in WRAPPERS:
        runner = _runner(f'{wrapper}-pretrained', root, model,
                         dict(WRAPPERS[wrapper], init_device='meta'))
        out[f'{wrapper}/pretrained'] = _full(runner)
    # a backbone that loads the file itself (mmdet's Swin): after init and after 2 iterations
    torch.manual_seed(11)
    own = {f'backbone.{k}': v.normal_()
           for k, v in MODELS.build(dict(type='SelfLoadingBackbone', table_len=6)).state_dict()
           .items()}
    own_file = os.path.join(root, 'own.pth')
    _save_rank0(dict(state_dict=dict(own, **{'neck.weight': torch.ones(2)})), own_file)
    out['own pretrained'] = own
    for wrapper in WRAPPERS:
        for init_device in (None, 'meta'):
            for iters in (0, 2):
                out[f'{wrapper}/{init_device}/own/{iters}'] = _full_or_error(
                    f'{wrapper}-{init_device}-own-{iters}', root,
                    dict(type='SelfLoadingZoo', checkpoint=own_file),
                    dict(WRAPPERS[wrapper], init_device=init_device),
                    train_cfg=dict(by_epoch=False, max_iters=iters, val_interval=iters + 1))
    # an init_cfg type not known to work on shards: an error at wrap time
    bad = build_on_meta(MODELS.build, dict(type='PretrainedZoo', init_type='Orthogonal'))
    out['bad init_cfg'] = _error(lambda: MMFullyShard.from_options(bad, init_device='meta'))

    # Hugging Face GPT-2, tied embeddings, meta init + load_from vs eager + load_from
    torch.manual_seed(5)
    gpt_ckpt = os.path.join(root, 'gpt2.pth')
    _save_rank0(dict(state_dict=MODELS.build(dict(type='TinyGPT2')).state_dict()), gpt_ckpt)
    gpt_wrapper = dict(type=FS, auto_wrap_policy=dict(type='transformer',
                                                      layer_cls=['GPT2Block']))
    for init_device in (None, 'meta'):
        runner = _runner(f'gpt2-{init_device}', root, dict(type='TinyGPT2'),
                         dict(gpt_wrapper, init_device=init_device), load_from=gpt_ckpt)
        gpt = runner.model.module.gpt
        out[f'gpt2/{init_device}'] = dict(
            _full(runner), tied=gpt.lm_head.weight is gpt.transformer.wte.weight)
    out['gpt2 checkpoint'] = torch.load(gpt_ckpt)['state_dict']
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> list:
    root = str(tmp_path_factory.mktemp('meta_init'))
    return run_distributed(_two_ranks, 2, root, timeout=400)


# ---------------------------------------------------------------- distributed checks

@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_meta_init_equals_eager_when_init_is_deterministic(runs, wrapper):
    meta, eager = runs[0][f'{wrapper}/meta'], runs[0][f'{wrapper}/None']
    assert max_abs_diff(meta['state'], eager['state']) == 0
    assert max_abs_diff(meta['buffers'], eager['buffers']) == 0
    state = meta['state']
    assert torch.equal(state['cls_token'], torch.zeros(1, 1, DIM))
    assert torch.equal(state['bias'], torch.full((DIM, ), 0.5))
    assert torch.equal(state['blocks.0.ls.gamma'], torch.full((DIM, ), 1e-2))
    assert torch.equal(state['blocks.1.attn.in_proj_bias'], torch.zeros(3 * DIM))
    assert torch.equal(meta['buffers']['position_ids'], torch.arange(5))
    assert torch.equal(meta['buffers']['steps'], torch.tensor([3, 1, 4]))
    assert runs[0][f'{wrapper}/meta/preprocessor device'] == 'cpu'


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_meta_init_with_load_from_equals_eager_with_load_from(runs, wrapper):
    meta, eager = runs[0][f'{wrapper}/meta/load_from'], runs[0][f'{wrapper}/None/load_from']
    assert max_abs_diff(meta['state'], eager['state']) == 0
    assert max_abs_diff(meta['buffers'], eager['buffers']) == 0
    assert torch.equal(meta['buffers']['position_ids'], torch.arange(5))  # not in checkpoints


def test_unwritten_tensor_is_the_same_error_on_every_rank(runs):
    messages = [r['unset error'] for r in runs]
    assert messages[0] == messages[1]
    assert messages[0].startswith('UnwrittenTensorsError')
    assert 'MetaZoo: unset (allocated empty by its constructor)' in messages[0]
    assert ('give `MetaZoo` a `reset_parameters`, set these tensors in `init_weights`, '
            'or provide them via `load_from`') in messages[0]


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_pretrained_init_cfg_under_meta_init_loads_the_pretrained_weights(runs, wrapper):
    state, pretrained = runs[0][f'{wrapper}/pretrained']['state'], runs[0]['pretrained']
    backbone = {k: v for k, v in state.items() if k.startswith('backbone.')}
    assert max_abs_diff(backbone, {k: v for k, v in pretrained.items()
                                if k.startswith('backbone.')}) == 0
    assert torch.equal(state['head.weight'], torch.full((3, DIM), 0.25))


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_backbone_loading_its_own_pretrained_under_meta_init_equals_eager(runs, wrapper):
    for iters in (0, 2):
        meta, eager = (runs[0][f'{wrapper}/{device}/own/{iters}'] for device in ('meta', None))
        assert isinstance(meta, dict), meta
        assert max_abs_diff(meta['state'], eager['state']) == 0, iters
        assert max_abs_diff(meta['buffers'], eager['buffers']) == 0, iters
    state, pretrained = runs[0][f'{wrapper}/meta/own/0']['state'], runs[0]['own pretrained']
    assert max_abs_diff({k: state[k] for k in pretrained if 'table' not in k},
                        {k: v for k, v in pretrained.items() if 'table' not in k}) == 0
    assert state['backbone.table'].shape == (4, 2)
    assert torch.equal(state['head.weight'], torch.full((NUM_CLASSES, DIM), 0.25))


def test_init_cfg_type_unknown_on_shards_fails_at_wrap_time(runs):
    for rank in runs:
        message = rank['bad init_cfg']
        assert message.startswith('ValueError'), message
        assert '`backbone` (ZooBackbone)' in message and "'Orthogonal'" in message


def test_hugging_face_gpt2_meta_init_with_load_from_equals_eager(runs):
    meta, eager = runs[0]['gpt2/meta'], runs[0]['gpt2/None']
    assert meta['tied'] and eager['tied']
    assert max_abs_diff(meta['state'], eager['state']) == 0
    assert max_abs_diff(meta['buffers'], eager['buffers']) == 0
    checkpoint = runs[0]['gpt2 checkpoint']
    assert max_abs_diff({k: meta['state'][k] for k in checkpoint}, checkpoint) == 0


# ---------------------------------------------------------------- one process

def test_empty_weights_puts_only_parameters_and_buffers_on_meta():
    from mmfsdp.meta_init import RECORD_LIMIT_BYTES, empty_weights, recorded
    with empty_weights():
        model = MetaZoo(unset=True)
        big = nn.Module()
        big.register_buffer('table', torch.zeros(RECORD_LIMIT_BYTES // 4 + 1))
        late = nn.Module()
        late.register_buffer('pe', torch.zeros(4, 4))
        late.pe[:, 0::2] = 1.0  # went to meta: lost, so not restorable
    assert model.rates == pytest.approx([0.0, 0.1])
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    values = recorded(model)
    assert torch.equal(values['position_ids'].value, torch.arange(5))
    assert torch.equal(values['cls_token'].value, torch.zeros(1, 1, DIM))
    assert values['unset'].value is None and values['unset'].missing == 'unset'
    assert recorded(model.embed)['weight'].missing == 'unset'  # torch.empty, reset later
    assert recorded(big)['table'].missing == 'too large'
    assert recorded(late)['pe'].missing == 'written after registration'
    assert not torch.empty(1).is_meta  # patches undone


def test_a_preprocessor_the_model_builds_itself_keeps_its_values_under_meta_init():
    from mmfsdp.meta_init import build_on_meta
    model = build_on_meta(MODELS.build, dict(type='MetaZoo', data_preprocessor=dict(
        mean=[1.0, 2.0, 3.0], std=[2.0, 2.0, 2.0])))  # no type: the model defaults it
    assert model.cls_token.is_meta
    assert model.data_preprocessor.mean.flatten().tolist() == [1.0, 2.0, 3.0]


def test_preprocessor_follows_the_training_device():
    from mmfsdp.meta_init import set_preprocessor_device
    model = MetaZoo(data_preprocessor=dict(type='BaseDataPreprocessor'))
    model.data_preprocessor.register_buffer('mean', torch.ones(3))
    set_preprocessor_device(model, torch.device('meta'))  # a device unlike the CPU
    assert model.data_preprocessor.device == torch.device('meta')
    assert model.data_preprocessor.mean.is_meta


def test_plan_cli_builds_constructors_that_compute(tmp_path, capsys):
    from mmfsdp.plan.__main__ import main
    cfg = tmp_path / 'zoo.py'
    cfg.write_text("model = dict(type='MetaZoo', depth=4)\n"
                   f'model_wrapper_cfg = dict(type={FS!r}, init_device="meta", '
                   "auto_wrap_policy=dict(type='transformer', layer_cls=['ZooBlock']))\n")
    main([str(cfg), '--world-size', '2'])
    out = capsys.readouterr().out
    assert 'construction peak' in out


def test_plan_construction_peak_follows_the_configured_path():
    from mmfsdp import MMFullyShard, MMFullyShardedDataParallel
    from mmfsdp.meta_init import empty_weights
    from mmfsdp.plan import Construction, plan_for
    with empty_weights(record=False):
        model = MetaZoo(depth=4)
    policy = dict(type='transformer', layer_cls=['ZooBlock'])
    cases = {Construction.SHARDS: (MMFullyShard, dict(auto_wrap_policy=policy,
                                                       init_device='meta')),
             Construction.FULL: (MMFullyShard, dict(auto_wrap_policy=policy)),
             Construction.UNIT_BY_UNIT: (MMFullyShardedDataParallel,
                                         dict(auto_wrap_policy=policy, init_device='meta'))}
    full = 4 * sum(p.numel() for p in model.parameters())
    for construction, (wrapper, cfg) in cases.items():
        plan = plan_for(wrapper, cfg, model, 2)
        assert plan.spec.construction is construction
        shards = sum(u.param_bytes for u in plan.units)
        expected = {Construction.SHARDS: shards, Construction.FULL: full,
                    Construction.UNIT_BY_UNIT: shards + 2 * 4 * max(u.numel for u in plan.units)}
        assert plan.construction_bytes_per_rank == expected[construction]
        assert shards < plan.construction_bytes_per_rank or construction is Construction.SHARDS
