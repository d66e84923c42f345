"""A hook may call the model outside the training step, under every wrapper, as under DDP.

XTuner's shipped configs carry ``EvaluateChatHook``, which calls the unwrapped
model's ``generate`` (reached through ``SupervisedFinetune.__getattr__``) before
the first iteration and every N iterations. Under sharding the root's
parameters (embeddings, final norm, LM head) are gathered only by the wrapper's
own forward, and a decoder layer called first would make itself FSDP2's root:
FSDP2 failed with ``aten.embedding.default got mixed torch.Tensor and DTensor``,
FSDP1 with ``'weight' must be 2-D``. Here a tiny Llama (transformers, no
download) in XTuner's model shape trains at 2 ranks with such a hook: every
rank generates what DDP generates, and training is what the stock Runner trains.
"""
from typing import Any

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import BaseModel, is_model_wrapper
from mmengine.registry import DATASETS, HOOKS, MODELS
from mmengine.runner import Runner
from torch.utils.data import Dataset

from harness import max_abs_diff, run_distributed
from toy import runner_config

transformers = pytest.importorskip('transformers', reason='pip install -e .[tests]')

VOCAB, SEQ, PER_RANK_BATCH, WORLD_SIZE, ITERS = 32, 8, 2, 2, 4
PROMPT = torch.tensor([[3, 6, 9, 12]])
TOL = 2e-5
LAYER = dict(type='transformer', layer_cls=['LlamaDecoderLayer'])
WRAPPERS = {'fsdp2': dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=LAYER),
            'fsdp1': dict(type='mmfsdp.MMFullyShardedDataParallel', auto_wrap_policy=LAYER),
            'ddp': dict(type='mmfsdp.MMDistributedDataParallel')}


@MODELS.register_module()
class TinyChatLM(BaseModel):
    """XTuner's ``SupervisedFinetune`` in miniature: an LLM as ``self.llm``, whose attributes
    (``generate``) the model answers for."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
        config._attn_implementation = 'eager'
        self.llm = transformers.LlamaForCausalLM(config)

    def forward(self, inputs: torch.Tensor, data_samples: Any = None, mode: str = 'loss') -> Any:
        return dict(loss=self.llm(input_ids=inputs, labels=inputs).loss)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.llm, name)


@DATASETS.register_module()
class CountingTokens(Dataset):
    """Token sequences counting up by 3 from a seeded start."""

    def __init__(self, length: int = 32) -> None:
        start = torch.randint(0, VOCAB, (length, 1), generator=torch.Generator().manual_seed(0))
        self.inputs = (start + 3 * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return dict(inputs=self.inputs[i])


@HOOKS.register_module()
class GenerateHook(Hook):
    """``EvaluateChatHook``'s calls: the unwrapped model's ``generate`` in eval mode, before
    training and every other iteration, on every rank (greedy, so the text is the weights')."""

    def __init__(self) -> None:
        self.generated = []

    def _generate(self, runner) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        model.eval()
        self.generated.append(model.generate(
            input_ids=PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0].tolist())
        model.train()

    def before_train(self, runner) -> None:
        self._generate(runner)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if (batch_idx + 1) % 2 == 0:
            self._generate(runner)


def _config(name: str, work_dir: str, wrapper=None, batch_size: int = PER_RANK_BATCH) -> Config:
    cfg = runner_config(name, work_dir, batch_size=batch_size, max_iters=ITERS, wrapper=wrapper,
                        launcher='pytorch' if wrapper else 'none')
    cfg['model'] = dict(type='TinyChatLM')
    cfg['train_dataloader']['dataset'] = dict(type='CountingTokens')
    cfg['custom_hooks'] = [dict(type='GenerateHook')]
    return Config(cfg)


def _hook(runner) -> GenerateHook:
    return next(h for h in runner.hooks if isinstance(h, GenerateHook))


def _two_ranks(root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from mmfsdp import FSDPRunner
    out = {}
    for name, wrapper in WRAPPERS.items():
        runner = FSDPRunner.from_cfg(_config(name, f'{root}/{name}', wrapper))
        runner.train()
        state = get_model_state_dict(runner.model, options=StateDictOptions(full_state_dict=True))
        out[name] = dict(generated=_hook(runner).generated,
                         state={k: v.detach().clone() for k, v in state.items()})
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('outside-step'))
    ranks = run_distributed(_two_ranks, WORLD_SIZE, root)
    stock = Runner.from_cfg(_config('stock', f'{root}/stock',
                                    batch_size=PER_RANK_BATCH * WORLD_SIZE))
    stock.train()
    return dict(ranks=ranks, stock=dict(
        generated=_hook(stock).generated,
        state={k: v.detach().clone() for k, v in stock.model.state_dict().items()}))


def test_ddp_generates_what_the_stock_runner_generates(runs):
    for rank in runs['ranks']:
        assert rank['ddp']['generated'] == runs['stock']['generated']
    assert len(runs['stock']['generated']) == 1 + ITERS // 2


@pytest.mark.parametrize('wrapper', ['fsdp2', 'fsdp1'])
def test_a_hook_calling_generate_gets_what_ddp_generates(runs, wrapper):
    for rank in runs['ranks']:
        assert rank[wrapper]['generated'] == rank['ddp']['generated']


@pytest.mark.parametrize('wrapper', sorted(WRAPPERS))
def test_generating_in_a_hook_leaves_training_as_the_stock_runner_trains(runs, wrapper):
    assert max_abs_diff(runs['ranks'][0][wrapper]['state'], runs['stock']['state']) < TOL
