"""Key names across layouts: wrapper prefixes, and a shared prefix that explains a mismatch.

DataParallel and DDP add ``module.``, ``torch.compile`` adds ``_orig_mod.``, in any order and
nesting, and also inside a model where a submodule was wrapped. Lightning adds the
LightningModule's attribute name (``model.``) to every key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from paratrain.checkpoints.weights import WRAPPER_PREFIXES, strip_prefixes

WRAPPER_SEGMENTS = tuple(prefix.rstrip(".") for prefix in WRAPPER_PREFIXES)
Shape = tuple[int, ...]


def drop_wrapper_segments(key: str) -> str:
    """``module.enc._orig_mod.w`` -> ``enc.w``: wrapper names removed wherever they are."""
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def _identity(key: str) -> str:
    return key


#: from most to least forgiving; the first one under which no two keys collide is used
CANONICAL_FORMS: tuple[Callable[[str], str], ...] = (
    drop_wrapper_segments,
    strip_prefixes,
    _identity,
)


def canonical_maps(
    source: Iterable[str], target: Iterable[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """``{canonical: original}`` for both sides, under one naming in which neither collides."""
    source, target = list(source), list(target)
    for form in CANONICAL_FORMS:
        src = {form(k): k for k in source}
        dst = {form(k): k for k in target}
        if len(src) == len(source) and len(dst) == len(target):
            return src, dst
    raise AssertionError("the identity form never collides")  # pragma: no cover


def wrapper_chain(key: str) -> str:
    """The wrapper prefixes ``key`` starts with, e.g. ``module._orig_mod.``."""
    return key[: len(key) - len(strip_prefixes(key))]


def common_prefix(keys: Iterable[str]) -> str:
    """The longest dotted prefix every key shares, leaving each at least one segment."""
    split = [key.split(".")[:-1] for key in keys]
    if len(split) < 2:
        return ""
    shared: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        shared.append(parts[0])
    return "".join(f"{part}." for part in shared)


def prefix_counts(keys: Iterable[str]) -> dict[str, int]:
    """Wrapper prefix chains found, with how many keys carry each, then a prefix that every
    key shares after them (Lightning's ``model.``)."""
    keys = list(keys)
    counts = Counter(chain for chain in map(wrapper_chain, keys) if chain)
    shared = common_prefix(strip_prefixes(k) for k in keys)
    result = dict(counts.most_common())
    if shared:
        result[shared] = len(keys)
    return result


def rename(keys: Iterable[str], old: str, new: str) -> dict[str, str] | None:
    """``{renamed: key}`` with ``old`` replaced by ``new`` at the start; None on a collision."""
    keys = list(keys)
    renamed = {(new + k[len(old) :] if k.startswith(old) else k): k for k in keys}
    return renamed if len(renamed) == len(keys) else None


def _majority_prefixes(keys: list[str], depth: int = 3) -> list[str]:
    counts: Counter[str] = Counter()
    for key in keys:
        parts = key.split(".")[:-1]
        for n in range(1, min(depth, len(parts)) + 1):
            counts[".".join(parts[:n]) + "."] += 1
    return [prefix for prefix, n in counts.items() if 2 * n >= len(keys)]


def find_rename(source: Mapping[str, Shape], target: Mapping[str, Shape]) -> tuple[str, str] | None:
    """The prefix rename ``(old, new)`` under which the most keys match name and shape, if
    it beats loading the names as they are."""
    unexpected = [k for k in source if k not in target]
    missing = [k for k in target if k not in source]
    if not unexpected or not missing:
        return None

    def score(names: Mapping[str, str]) -> tuple[int, int]:
        named = [n for n in names if n in target]
        return sum(source[names[n]] == target[n] for n in named), len(named)

    best, best_score = None, score({k: k for k in source})
    for old in ["", *_majority_prefixes(unexpected)]:
        for new in ["", *_majority_prefixes(missing)]:
            renamed = rename(source, old, new) if old != new else None
            if renamed is not None and score(renamed) > best_score:
                best, best_score = (old, new), score(renamed)
    return best


def describe_rename(old: str, new: str) -> str:
    if old and not new:
        why = " (the LightningModule attribute?)" if old == "model." else ""
        return f"removed the prefix {old!r} that the checkpoint's keys carry{why}"
    if new and not old:
        return f"added the prefix {new!r} that the model's keys carry"
    return f"renamed the checkpoint's prefix {old!r} to {new!r}"
