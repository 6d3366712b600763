"""A small GPT-style language model whose width and depth are settings, so that it can be
made as large as sharding needs (``fsdp``).

The repeated ``TransformerBlock`` layers are what FSDP's default policy shards one by one;
the token embedding, positions, final norm and head stay with the root. With a tied head
(``tie=True``) the head reuses the embedding's weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention and an MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        # under tensor parallelism qkv gives this process's heads only, and ``heads`` counts
        # them (paratrain.strategies.tensor_parallel): the widths come from qkv's output
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=2)
        width = q.shape[2]
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Tokens ``(batch, length)`` -> next-token logits ``(batch, length, vocab)``."""

    def __init__(
        self,
        vocab: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        context: int = 32,
        tie: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.empty(context, width))
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.init_module(self)

    def init_module(self, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters that its ``reset_parameters`` does not
        (the positions); paratrain.models.meta_init calls it per module of a model built on meta."""
        if module is self:
            nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TokenCrossEntropy(nn.Module):
    """Cross-entropy of every position's next-token logits, averaged over all positions;
    ``logits`` may be a model's output that holds them (Hugging Face's ``.logits``)."""

    def forward(self, logits: Any, targets: Tensor) -> Tensor:
        scores: Tensor = getattr(logits, "logits", logits)
        return F.cross_entropy(scores.flatten(0, 1), targets.flatten())


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
