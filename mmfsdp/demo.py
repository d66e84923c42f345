"""Demo workload: a character-level GPT trained on the Python standard library's source.

It trains on two CPU processes in minutes yet is shaped like the models FSDP is
for: a stack of identical ``TransformerBlock`` units to wrap, and an ``lm_head``
tied to the token embedding, which sharding must not untie. The corpus needs no
download: every machine that runs mmfsdp has a stdlib. Importing this module
registers ``GPT``, ``StdlibCharDataset`` and ``Perplexity`` under the ``mmfsdp``
scope (the registries import it on the first lookup)::

    model = dict(type='mmfsdp.GPT', vocab_size=256, block_size=64, n_layer=4, n_head=4,
                 n_embd=128)
    model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard',
                             auto_wrap_policy=dict(type='transformer',
                                                   layer_cls=['TransformerBlock']))
"""
import functools
import math
import os
import sysconfig
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from torch import nn
from torch.utils.data import Dataset

from mmfsdp.registry import DATASETS, METRICS, MODELS

__all__ = ['GPT', 'Perplexity', 'StdlibCharDataset', 'TransformerBlock']

INIT_STD = 0.02
VOCAB_SIZE = 256  # byte values: the same on every machine, whatever files a Python install has
SPLITS = ('train', 'val')
# Third-party packages may live under the stdlib directory and differ between installs.
SKIPPED_DIRS = frozenset({'site-packages', 'dist-packages', '__pycache__'})


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    ``is_causal=True`` needs no mask buffer, which would have to be kept
    consistent across shards and checkpoints for no gain.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f'n_embd ({n_embd}) must be divisible by n_head ({n_head})')
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)  # into the residual stream: scaled at init
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape (B, T, C); position t sees only <= t."""
        batch, seq_len, channels = x.shape
        q, k, v = (t.view(batch, seq_len, self.n_head, channels // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(channels, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq_len, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network (4x expansion, GELU)."""

    def __init__(self, n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)  # into the residual stream: scaled at init
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape (B, T, C)."""
        return self.dropout(self.proj(self.act(self.fc(x))))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block, ``x + attn(ln(x))`` then ``x + mlp(ln(x))``: one FSDP unit."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One residual attention + MLP step on ``x`` of shape (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def residual_projections(self) -> list:
        """The Linear layers whose output is added to the residual stream."""
        return [self.attn.proj, self.mlp.proj]


@MODELS.register_module()
class GPT(BaseModel):
    """Decoder-only transformer over token ids.

    ``inputs`` and ``data_samples`` are LongTensors (B, T): the token ids and
    each position's next-token target (the default ``BaseDataPreprocessor``
    passes them through). ``tie_weights`` shares ``wte``'s matrix with
    ``lm_head``, as GPT-2 does.
    """

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float = 0.0, tie_weights: bool = True,
                 data_preprocessor: Optional[Union[dict, nn.Module]] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight

    def init_weights(self) -> None:
        """GPT-2 initialisation from torch's global RNG.

        Linear and Embedding weights ~ N(0, 0.02), biases 0, LayerNorm (1, 0);
        residual projections ~ N(0, 0.02 / sqrt(2 * n_layer)) so the residual
        stream's variance does not grow with depth.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        residual_std = INIT_STD / math.sqrt(2 * self.n_layer)
        for block in self.blocks:
            for proj in block.residual_projections():
                nn.init.normal_(proj.weight, mean=0.0, std=residual_std)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, T, vocab_size) for token ids (B, T)."""
        seq_len = inputs.size(1)
        if seq_len > self.block_size:
            raise ValueError(f'sequence length {seq_len} exceeds block_size {self.block_size}')
        positions = torch.arange(seq_len, device=inputs.device)
        x = self.drop(self.wte(inputs) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, inputs: torch.Tensor, data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor'
                ) -> Union[torch.Tensor, Dict[str, torch.Tensor], List[dict]]:
        """Run in one of mmengine's modes.

        ``'loss'``: ``dict(loss=mean cross-entropy)``; ``'tensor'``: the logits;
        ``'predict'``: per sample ``dict(nll=summed token NLL, num_tokens=T)``, what
        :class:`Perplexity` consumes.
        """
        if mode not in ('loss', 'predict', 'tensor'):
            raise ValueError(f"mode must be 'loss', 'predict' or 'tensor', got {mode!r}")
        logits = self.logits(inputs)
        if mode == 'tensor':
            return logits
        if data_samples is None:
            raise ValueError(f'mode={mode!r} needs the targets in `data_samples`')
        # float() so that reduced-precision logits do not degrade the loss.
        token_nll = F.cross_entropy(logits.float().flatten(0, 1), data_samples.flatten(),
                                    reduction='none').view_as(data_samples)
        if mode == 'loss':
            return dict(loss=token_nll.mean())
        num_tokens = data_samples.size(1)
        return [dict(nll=nll, num_tokens=num_tokens) for nll in token_nll.detach().sum(1).cpu()]


@METRICS.register_module()
class Perplexity(BaseMetric):
    """Token-weighted mean NLL (``lm/nll``) and its exponential (``lm/perplexity``).

    Sums are kept, not per-batch means, so the result is exact however samples
    are split across batches and ranks. The mean is not called ``loss``:
    mmengine's LogProcessor would average it over successive validations.
    """

    default_prefix = 'lm'

    def process(self, data_batch: dict, data_samples: Sequence[dict]) -> None:
        """Store each sample's NLL sum and token count as Python numbers."""
        for sample in data_samples:
            self.results.append(dict(nll=float(sample['nll']),
                                     num_tokens=int(sample['num_tokens'])))

    def compute_metrics(self, results: List[dict]) -> Dict[str, float]:
        """Reduce the samples of all ranks to mean NLL and perplexity."""
        num_tokens = sum(r['num_tokens'] for r in results)
        if num_tokens == 0:
            raise ValueError('Perplexity got no tokens to evaluate')
        nll = sum(r['nll'] for r in results) / num_tokens
        return dict(nll=nll, perplexity=math.exp(nll))


@functools.lru_cache(maxsize=4)  # the train and val datasets of one process read once
def read_stdlib_bytes(max_chars: int, root: Optional[str] = None) -> bytes:
    """The first ``max_chars`` bytes of the stdlib's ``.py`` files, in sorted walk order.

    Reading stops at the limit, so the cost does not grow with the install.
    """
    root = root or sysconfig.get_paths()['stdlib']
    chunks = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place makes os.walk visit sub-directories in order.
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIPPED_DIRS and not d.startswith('.'))
        for name in sorted(f for f in filenames if f.endswith('.py')):
            with open(os.path.join(dirpath, name), 'rb') as f:
                chunk = f.read(max_chars - total) + b'\n'
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_chars:
                return b''.join(chunks)[:max_chars]
    return b''.join(chunks)


@DATASETS.register_module()
class StdlibCharDataset(Dataset):
    """Windows of stdlib source for next-byte prediction, the same on every rank.

    Item ``i`` is ``dict(inputs=w[:-1], data_samples=w[1:])`` for a window ``w``
    of ``block_size + 1`` bytes. ``split='train'`` is the first
    ``1 - val_fraction`` of ``max_chars`` bytes, ``'val'`` the rest; windows
    start every ``stride`` bytes (default ``block_size``), or ``num_samples``
    windows are spread evenly over the split. Nothing is drawn from an RNG.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, block_size: int, split: str = 'train', max_chars: int = 2_000_000,
                 val_fraction: float = 0.1, stride: Optional[int] = None,
                 num_samples: Optional[int] = None, root: Optional[str] = None):
        if split not in SPLITS:
            raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction}')
        if block_size < 1:
            raise ValueError(f'block_size must be positive, got {block_size}')
        text = read_stdlib_bytes(max_chars, root)
        cut = int(len(text) * (1.0 - val_fraction))
        part = text[:cut] if split == 'train' else text[cut:]
        window = block_size + 1
        if len(part) < window:
            raise ValueError(f'the {split!r} split has {len(part)} bytes, fewer than one window '
                             f'of block_size + 1 = {window}; raise max_chars')
        self.block_size = block_size
        self.split = split
        self.data = torch.frombuffer(bytearray(part), dtype=torch.uint8)  # widened per item
        last_start = len(part) - window
        if num_samples is not None:
            if not 1 <= num_samples <= last_start + 1:
                raise ValueError(f'num_samples must be in [1, {last_start + 1}] for this '
                                 f'split, got {num_samples}')
            spacing = last_start / max(num_samples - 1, 1)
            self.starts = (torch.arange(num_samples, dtype=torch.float64) * spacing).round().long()
        else:
            stride = block_size if stride is None else stride
            if stride < 1:
                raise ValueError(f'stride must be positive, got {stride}')
            self.starts = torch.arange(0, last_start + 1, stride)

    @property
    def metainfo(self) -> Dict[str, Any]:
        """What mmengine hands the metric and visualizer as ``dataset_meta``."""
        return dict(vocab_size=self.vocab_size, block_size=self.block_size, split=self.split)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        start = int(self.starts[index])
        window = self.data[start:start + self.block_size + 1].long()
        return dict(inputs=window[:-1], data_samples=window[1:])
