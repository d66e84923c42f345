"""A small character-level GPT as an mmengine ``BaseModel``.

It is the demo workload of mmfsdp: small enough to train on two CPU
processes in minutes, yet shaped like the models FSDP is meant for (a stack of
identical ``TransformerBlock`` units to wrap, and an ``lm_head`` whose weight
is tied to the token embedding, the classic case that sharding must not
untie).
"""
import math
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from mmfsdp.registry import MODELS

from .blocks import TransformerBlock

INIT_STD = 0.02


@MODELS.register_module()
class GPT(BaseModel):
    """Decoder-only transformer language model over token ids.

    Data contract (what mmengine's default ``BaseDataPreprocessor`` passes
    through unchanged apart from the device move): ``inputs`` is a LongTensor
    (B, T) of token ids and ``data_samples`` a LongTensor (B, T) holding the
    next-token target of every position.

    Args:
        vocab_size: Number of token ids.
        block_size: Longest sequence the position embedding covers.
        n_layer: Number of ``TransformerBlock`` modules.
        n_head: Attention heads per block.
        n_embd: Width of the residual stream.
        dropout: Dropout probability (embeddings, attention, MLP).
        tie_weights: Share one matrix between ``wte`` and ``lm_head``
            (GPT-2 does; it saves ``vocab_size * n_embd`` parameters).
        data_preprocessor: Config or module for the data preprocessor;
            ``None`` gives mmengine's ``BaseDataPreprocessor``.

    """

    def __init__(self,
                 vocab_size: int,
                 block_size: int,
                 n_layer: int,
                 n_head: int,
                 n_embd: int,
                 dropout: float = 0.0,
                 tie_weights: bool = True,
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
        """GPT-2 initialisation, drawn from torch's global RNG.

        Linear and Embedding weights ~ N(0, 0.02), biases 0, LayerNorm
        (1, 0), and the residual projections ~ N(0, 0.02 / sqrt(2 * n_layer))
        so the residual stream's variance does not grow with depth. The
        values drawn depend on each parameter's shape, so running this on
        full tensors and on local shards gives observably different weights.
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
            raise ValueError(f'sequence length {seq_len} exceeds block_size '
                             f'{self.block_size}')
        positions = torch.arange(seq_len, device=inputs.device)
        x = self.drop(self.wte(inputs) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def forward(self,
                inputs: torch.Tensor,
                data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor'
                ) -> Union[torch.Tensor, Dict[str, torch.Tensor], List[dict]]:
        """Run the model in one of mmengine's three modes.

        Args:
            inputs: Token ids, LongTensor (B, T).
            data_samples: Next-token targets, LongTensor (B, T); required
                by ``'loss'`` and ``'predict'``.
            mode: ``'loss'`` returns ``dict(loss=mean cross-entropy)``;
                ``'predict'`` returns one dict per sample with ``nll`` (the
                summed token NLL, a float tensor on CPU) and ``num_tokens``
                (int), what the ``Perplexity`` metric needs; ``'tensor'``
                returns the logits.

        """
        if mode not in ('loss', 'predict', 'tensor'):
            raise ValueError(f"mode must be 'loss', 'predict' or 'tensor', "
                             f'got {mode!r}')
        logits = self.logits(inputs)
        if mode == 'tensor':
            return logits
        if data_samples is None:
            raise ValueError(f"mode={mode!r} needs the targets in "
                             '`data_samples`')
        # float() so that reduced-precision logits do not degrade the loss.
        token_nll = F.cross_entropy(
            logits.float().flatten(0, 1), data_samples.flatten(),
            reduction='none').view_as(data_samples)
        if mode == 'loss':
            return dict(loss=token_nll.mean())
        sample_nll = token_nll.detach().sum(dim=1).cpu()
        num_tokens = data_samples.size(1)
        return [
            dict(nll=nll, num_tokens=num_tokens) for nll in sample_nll
        ]
