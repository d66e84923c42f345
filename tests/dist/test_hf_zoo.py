"""A real third-party zoo: Hugging Face ``transformers`` models trained through mmfsdp.

``ViTForImageClassification`` and ``GPT2LMHeadModel`` (tied input and output
embeddings), built from tiny configs (no download), each inside an mmengine
``BaseModel`` with the stock ``EMAHook`` and a ``BaseMetric``. One 2-rank group
trains both under FSDP1, FSDP2 and DDP; each run must equal mmengine's stock
``Runner`` training the same global batch in this process: weights, averaged
weights and the validation metric (computed with the averaged weights).
"""
import copy
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from mmengine.runner import Runner
from torch.utils.data import Dataset

import toy  # noqa: F401  (registers ToyMetric: mean nll and accuracy of the predictions)
from harness import DIST_CFG, max_abs_diff, run_distributed

transformers = pytest.importorskip('transformers', reason='pip install -e .[tests]')

TOL = 2e-5
PER_RANK_BATCH, WORLD_SIZE, ITERS = 4, 2, 4
IMAGE, CHANNELS, CLASSES, VOCAB, SEQ = 8, 3, 3, 32, 8
EMA = dict(type='EMAHook', momentum=0.2)


@MODELS.register_module()
class HFViT(BaseModel):
    """``ViTForImageClassification`` from a tiny config, mmengine's step interface."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.ViTConfig(
            image_size=IMAGE, patch_size=4, num_channels=CHANNELS, hidden_size=16,
            num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config._attn_implementation = 'eager'
        self.net = transformers.ViTForImageClassification(config)

    def forward(self, inputs: torch.Tensor, data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = self.net(pixel_values=inputs).logits
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, data_samples))
        if mode == 'predict':
            nll = F.cross_entropy(logits, data_samples, reduction='none')
            return [dict(nll=n, correct=c) for n, c in
                    zip(nll.detach(), (logits.argmax(-1) == data_samples).float())]
        return logits


@MODELS.register_module()
class HFGPT2(BaseModel):
    """``GPT2LMHeadModel`` (tied embeddings) from a tiny config; next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0)
        config._attn_implementation = 'eager'
        self.net = transformers.GPT2LMHeadModel(config)

    def forward(self, inputs: torch.Tensor, data_samples: Any = None,
                mode: str = 'tensor') -> Any:
        logits = self.net(input_ids=inputs).logits[:, :-1]
        targets = inputs[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction='none').mean(-1)
        if mode == 'loss':
            return dict(loss=nll.mean())
        if mode == 'predict':
            correct = (logits.argmax(-1) == targets).float().mean(-1)
            return [dict(nll=n, correct=c) for n, c in zip(nll.detach(), correct)]
        return logits


@DATASETS.register_module()
class HFZooData(Dataset):
    """Images with labels from a fixed projection, or token sequences with a pattern."""

    def __init__(self, kind: str, length: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.labels = [None] * length
        if kind == 'image':
            self.inputs = torch.randn(length, CHANNELS, IMAGE, IMAGE, generator=gen)
            weights = torch.randn(CHANNELS * IMAGE * IMAGE, CLASSES, generator=gen)
            self.labels = list((self.inputs.flatten(1) @ weights).argmax(-1))
        else:
            start = torch.randint(0, VOCAB, (length, 1), generator=gen)
            self.inputs = (start + 3 * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        if self.labels[i] is None:
            return dict(inputs=self.inputs[i])
        return dict(inputs=self.inputs[i], data_samples=self.labels[i])


#: model -> (its dataset kind, its transformer layer, its embedding layer). FSDP2 units
#: include the embeddings, so GPT-2's tied wte / lm_head take the merge of units sharing
#: a parameter (mmfsdp.policies.merge_units_sharing_parameters).
MODELS_UNDER_TEST = {'HFViT': ('image', 'ViTLayer', 'ViTEmbeddings'),
                     'HFGPT2': ('tokens', 'GPT2Block', 'Embedding')}


def _wrappers(layer: str, embedding: str) -> dict:
    return {
        'fsdp1': dict(type='mmfsdp.MMFullyShardedDataParallel',
                      auto_wrap_policy=dict(type='transformer', layer_cls=[layer])),
        'fsdp2': dict(type='mmfsdp.MMFullyShard',
                      auto_wrap_policy=dict(type='transformer', layer_cls=[layer, embedding])),
        'ddp': dict(type='mmfsdp.MMDistributedDataParallel'),
    }


def _config(model: str, work_dir: str, wrapper: Optional[dict], batch_size: int) -> Config:
    kind = MODELS_UNDER_TEST[model][0]

    def loader(length: int, seed: int, shuffle: bool) -> dict:
        sampler = dict(type='DefaultSampler', shuffle=shuffle)
        if shuffle:
            sampler['seed'] = 0
        return dict(dataset=dict(type='HFZooData', kind=kind, length=length, seed=seed),
                    sampler=sampler, collate_fn=dict(type='default_collate'),
                    batch_size=batch_size, num_workers=0)

    cfg = dict(
        model=dict(type=model), work_dir=work_dir, experiment_name=model,
        launcher='none' if wrapper is None else 'pytorch', env_cfg=dict(dist_cfg=DIST_CFG),
        randomness=dict(seed=1),
        train_dataloader=loader(32, 0, True),
        train_cfg=dict(by_epoch=False, max_iters=ITERS, val_interval=ITERS),
        val_dataloader=loader(8, 1, False), val_cfg=dict(),
        val_evaluator=dict(type='ToyMetric'),
        # SGD: Adam's normalisation turns float summation-order noise in near-zero
        # gradients into differences of the order of lr, which says nothing about sharding
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9)),
        default_hooks=dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1)),
        custom_hooks=[copy.deepcopy(EMA)], log_level='WARNING')
    if wrapper is not None:
        cfg.update(runner_type='mmfsdp.FSDPRunner', model_wrapper_cfg=wrapper)
    return Config(copy.deepcopy(cfg))


def _result(runner, averaged: dict) -> dict:
    return dict(averaged={k: v.detach().clone().float() for k, v in averaged.items()},
                val_nll=float(runner.message_hub.get_scalar('val/nll').current()),
                val_accuracy=float(runner.message_hub.get_scalar('val/accuracy').current()))


def _train_all(root: str) -> dict:
    import mmfsdp  # noqa: F401
    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    out = {}
    for model, (_, layer, embedding) in MODELS_UNDER_TEST.items():
        for name, wrapper in _wrappers(layer, embedding).items():
            runner = FSDPRunner.from_cfg(_config(model, f'{root}/{model}-{name}', wrapper,
                                                 PER_RANK_BATCH))
            runner.train()
            hook = next(h for h in runner.hooks if type(h).__name__ == 'EMAHook')
            result = _result(runner, hook.averaged_state_dict(runner))
            result['model'] = {k: v.clone().float() for k, v in
                               gather_full_state(runner.model, None)[0].items()}
            out[f'{model}/{name}'] = result
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def distributed(tmp_path_factory) -> dict:
    return run_distributed(_train_all, WORLD_SIZE, str(tmp_path_factory.mktemp('hf')),
                           timeout=480)[0]


@pytest.fixture(scope='module')
def reference(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp('hf-ref')
    out = {}
    for model in MODELS_UNDER_TEST:
        runner = Runner.from_cfg(_config(model, str(root / model), None,
                                         PER_RANK_BATCH * WORLD_SIZE))
        runner.train()
        hook = next(h for h in runner.hooks if type(h).__name__ == 'EMAHook')
        result = _result(runner, hook.ema_model.module.state_dict())
        result['model'] = {k: v.detach().clone().float()
                           for k, v in runner.model.state_dict().items()}
        out[model] = result
    return out


@pytest.mark.parametrize('model', list(MODELS_UNDER_TEST))
@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2', 'ddp'])
def test_hf_model_with_ema_trains_like_one_process(distributed, reference, model, wrapper):
    got, expected = distributed[f'{model}/{wrapper}'], reference[model]
    weights = max_abs_diff(got['model'], expected['model'])
    averaged = max_abs_diff(got['averaged'], expected['averaged'])
    print(f'{model} {wrapper}: max abs diff weights {weights:.1e}, averaged {averaged:.1e}, '
          f"val nll {got['val_nll']:.6f} vs {expected['val_nll']:.6f}")
    assert weights <= TOL and averaged <= TOL
    assert got['val_nll'] == pytest.approx(expected['val_nll'], abs=TOL)
    assert got['val_accuracy'] == pytest.approx(expected['val_accuracy'], abs=1e-6)
    assert max_abs_diff(got['model'], got['averaged']) > 1e-3  # the average is not the weights


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2', 'ddp'])
def test_gpt2_keeps_its_embeddings_tied(distributed, wrapper):
    for state in (distributed[f'HFGPT2/{wrapper}']['model'],
                  distributed[f'HFGPT2/{wrapper}']['averaged']):
        assert torch.equal(state['net.lm_head.weight'], state['net.transformer.wte.weight'])
