"""Transformer building blocks of the demo GPT.

``TransformerBlock`` is the unit that FSDP auto-wrap policies name
(``layer_cls=['TransformerBlock']``): each block becomes one FSDP unit, so
only one block's parameters need to be gathered at a time.
"""
import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention built from plain ``nn.Linear`` layers.

    The attention itself is ``F.scaled_dot_product_attention`` with
    ``is_causal=True``, so no mask buffer is needed (a buffer would have to
    be kept consistent across FSDP shards and checkpoints for no gain).

    Args:
        n_embd: Width of the residual stream.
        n_head: Number of attention heads; must divide ``n_embd``.
        dropout: Dropout probability on attention weights and the output.

    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(
                f'n_embd ({n_embd}) must be divisible by n_head ({n_head})')
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        # ``proj`` writes into the residual stream: GPT.init_weights scales it.
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape (B, T, C); position t sees only <= t."""
        batch, seq_len, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        head_dim = channels // self.n_head
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (
            t.view(batch, seq_len, self.n_head, head_dim).transpose(1, 2)
            for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq_len, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network (4x expansion, GELU).

    Args:
        n_embd: Width of the residual stream.
        dropout: Dropout probability on the output.

    """

    def __init__(self, n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        # ``proj`` writes into the residual stream: GPT.init_weights scales it.
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape (B, T, C)."""
        return self.dropout(self.proj(self.act(self.fc(x))))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, ``x + mlp(ln(x))``.

    Args:
        n_embd: Width of the residual stream.
        n_head: Number of attention heads.
        dropout: Dropout probability used by attention and MLP.

    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run one residual attention + MLP step on ``x`` of shape (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def residual_projections(self) -> list:
        """The Linear layers whose output is added to the residual stream."""
        return [self.attn.proj, self.mlp.proj]
