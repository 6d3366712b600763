"""Token sequences from a seeded random Markov chain: a tiny "language" with structure a
model can learn (each token has a few likely successors), generated, never downloaded."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def markov_tokens(
    count: int, length: int, vocab: int = 64, successors: int = 3, seed: int = 0
) -> TensorDataset:
    """``count`` sequences: inputs ``(count, length)`` and next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    # Each token goes to one of `successors` tokens, with uneven probabilities.
    choices = torch.stack(
        [torch.randperm(vocab, generator=generator)[:successors] for _ in range(vocab)]
    )
    weights = torch.softmax(torch.randn(vocab, successors, generator=generator) * 2, dim=1)
    sequences = torch.empty(count, length + 1, dtype=torch.long)
    sequences[:, 0] = torch.randint(vocab, (count,), generator=generator)
    for position in range(length):
        current = sequences[:, position]
        pick = torch.multinomial(weights[current], 1, generator=generator).squeeze(1)
        sequences[:, position + 1] = choices[current, pick]
    return TensorDataset(sequences[:, :-1].clone(), sequences[:, 1:].clone())
