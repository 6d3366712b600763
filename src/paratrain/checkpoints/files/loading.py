"""``load_weights``: any supported checkpoint into a model of any layout."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.checkpoints.files.formats import Checkpoint, Source, read_checkpoint
from paratrain.checkpoints.files.keys import canonical_maps, describe_rename, find_rename, rename
from paratrain.checkpoints.files.report import LoadReport, ShapeMismatch, WeightsMismatchError
from paratrain.checkpoints.weights import unwrap_model
from paratrain.distributed.dtensors import shard_like


def load_weights(model: nn.Module, source: Source | Checkpoint, strict: bool = True) -> LoadReport:
    """Load ``source`` into ``model``, whatever layout either was saved or built in.

    ``source``: a ``.safetensors`` or ``torch.save`` file (a state dict, or a dict holding one
    under ``state_dict``/``model``), a paratrain run or checkpoint directory, a dict, or a
    module. ``model``: bare, ``nn.DataParallel``, DDP, FSDP (``fully_shard``: every process
    loads its own shards, no communication), a pipeline stage (it loads its part) or
    ``torch.compile``-d. Wrapper prefixes
    (``module.``, ``_orig_mod.``) are matched in any order; a prefix the checkpoint's keys
    share (Lightning's ``model.``) is removed when that makes them match, with a hint.

    ``strict=True`` raises :class:`WeightsMismatchError`, whose message is a table of the
    missing, unexpected and mis-shaped tensors, and loads nothing. ``strict=False`` loads
    what matches. Either way the returned :class:`LoadReport` says what happened;
    ``print(report)`` shows the table. No pickled code in ``source`` is ever run.
    """
    checkpoint = source if isinstance(source, Checkpoint) else read_checkpoint(source)
    target = unwrap_model(model)
    report, state = match_weights(target, checkpoint)
    if strict and not report.ok:
        raise WeightsMismatchError(report)
    current = target.state_dict()
    # A pipeline stage is matched as the whole model, then takes its own part.
    state = {key: value for key, value in state.items() if key in current}
    # A sharded (FSDP) model takes this process's part of each full tensor.
    state = {key: shard_like(value, current[key]) for key, value in state.items()}
    with torch.no_grad():
        target.load_state_dict(state, strict=strict)
    return report


def match_weights(
    target: nn.Module, checkpoint: Checkpoint
) -> tuple[LoadReport, dict[str, torch.Tensor]]:
    """Pair the checkpoint's tensors with ``target``'s keys; nothing is loaded here."""
    whole = getattr(target, "full_state_shapes", None)  # a pipeline stage: the whole model's
    if callable(whole):
        model_shapes = dict(whole())
    else:
        model_shapes = {k: tuple(v.shape) for k, v in target.state_dict().items()}
    ckpt_shapes = {k: tuple(v.shape) for k, v in checkpoint.tensors.items()}
    src, dst = canonical_maps(ckpt_shapes, model_shapes)
    src_shapes = {c: ckpt_shapes[k] for c, k in src.items()}
    dst_shapes = {c: model_shapes[k] for c, k in dst.items()}

    hints: list[str] = []
    names: dict[str, str] = {c: c for c in src}  # the model's canonical name -> checkpoint's
    found = find_rename(src_shapes, dst_shapes)
    if found is not None:
        renamed = rename(src_shapes, *found)
        assert renamed is not None
        names = renamed
        hints.append(describe_rename(*found))

    loaded: list[str] = []
    missing: list[str] = []
    mismatched: list[ShapeMismatch] = []
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for canon, key in dst.items():
        if canon not in names:
            missing.append(key)
            continue
        ckpt_key = src[names[canon]]
        used.add(ckpt_key)
        if ckpt_shapes[ckpt_key] != model_shapes[key]:
            mismatched.append(ShapeMismatch(key, ckpt_shapes[ckpt_key], model_shapes[key]))
            continue
        loaded.append(key)
        state[key] = checkpoint.tensors[ckpt_key]
    unexpected = [k for k in checkpoint.tensors if k not in used]
    hints += _explain(loaded, missing, unexpected)
    report = LoadReport(
        loaded,
        missing,
        unexpected,
        mismatched,
        source=checkpoint.label(),
        hints=hints,
        model_shapes=model_shapes,
        checkpoint_shapes=ckpt_shapes,
    )
    return report, state


def _explain(loaded: list[str], missing: list[str], unexpected: list[str]) -> list[str]:
    if not loaded and missing and unexpected:
        return [
            "no name matches: is this checkpoint for another model? its keys look like "
            f"{', '.join(unexpected[:2])}; the model's like {', '.join(missing[:2])}"
        ]
    if missing and all(k.endswith("num_batches_tracked") for k in missing):
        return [
            "only BatchNorm's num_batches_tracked counters are missing (an older checkpoint); "
            "strict=False loads it safely"
        ]
    return []
