"""Where a model given as a list of blocks is cut into pipeline stages: at the blocks the
user names, or where the stages' parameter counts are most even.

The models whose stages are built from their block list (Hugging Face decoders,
:mod:`.decoder_stages`; timm's ViT and ResNet, :mod:`.timm_stages`) share this; plain
Python on one process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from paratrain.utils.errors import UserError


def block_starts(
    kind: str,
    blocks: Sequence[str],
    weights: Sequence[int],
    num_stages: int,
    split_points: Sequence[str],
    aliases: Mapping[str, str] | None = None,
) -> list[int]:
    """The indices into ``blocks`` (after 0) where stages 2, 3, ... begin, or ``UserError``;
    ``split_points`` are submodules of the model, one per stage after the first (the caller
    checked). ``aliases``: other names of a block a split point may give (``layer3``:
    ``layer3.0``)."""
    if not split_points:
        if len(blocks) < num_stages:
            raise UserError(
                f"--strategy pipeline with {num_stages} stages needs at least {num_stages} "
                f"blocks to split between, and {kind} has {len(blocks)}; use fewer processes"
            )
        return min_max_partition(weights, num_stages)
    named = [(aliases or {}).get(name, name) for name in split_points]
    unknown = [given for given, name in zip(split_points, named, strict=True) if name not in blocks]
    if unknown:
        example = blocks[1] if len(blocks) > 1 else blocks[0]
        raise UserError(
            f"--pipeline-split {','.join(unknown)}: {kind} is cut between its blocks; "
            f"name blocks that start stages 2, 3, ... ({example}, ...)"
        )
    starts = [list(blocks).index(name) for name in named]
    if starts != sorted(set(starts)) or 0 in starts:
        raise UserError(
            f"--pipeline-split {','.join(split_points)}: name blocks after the first, in "
            "the order the model runs them"
        )
    return starts


def min_max_partition(weights: Sequence[int], parts: int) -> list[int]:
    """Indices (after the first) where ``parts`` contiguous groups of ``weights`` begin,
    minimizing the largest group's sum."""
    n = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = float("inf")
    # cost[k][i]: the best largest sum splitting the first i weights into k groups
    cost = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    cost[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(cost[k - 1][j], prefix[i] - prefix[j])
                if value < cost[k][i]:
                    cost[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)[1:]
