"""``paratrain export``: a quantized copy of a trained run's model, measured before and after."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain.checkpoints.files import load_weights
from paratrain.tools.export.artifact import load_quantized, save_quantized, settings_from
from paratrain.tools.export.measure import Figures, evaluate, latency, saved_bytes
from paratrain.tools.export.torchao_api import (
    DESCRIPTIONS,
    SCHEMES,
    device_for,
    import_torchao,
    int4_unsupported,
    quantizable,
    quantize,
    torchao_version,
)
from paratrain.training import run_files, rundir
from paratrain.training.recipes import get_recipe
from paratrain.utils.atomic import FULL, full_figures, full_headline, make_room
from paratrain.utils.errors import UserError

CHECKPOINTS = "checkpoints"


@dataclass
class ExportReport:
    source: str
    recipe: str
    scheme: str
    description: str
    out: str
    device: str
    batch_size: int
    repeats: int
    before: Figures
    after: Figures
    quantized_layers: list[str]
    weight_layers: int
    #: the quantized model read back from ``out`` gave the same outputs as before saving
    reload_matches: bool
    torchao: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k not in ("before", "after")},
            "before": self.before.to_dict(),
            "after": self.after.to_dict(),
        }


def locate_run(source: str | Path) -> Path:
    """The run directory of ``source``: a run (``--out``) or one of its checkpoints."""
    path = Path(source)
    if path.is_dir() and (path / rundir.CONFIG).is_file():
        if not (path / rundir.WEIGHTS).is_file():
            raise UserError(
                f"{path} has no {rundir.WEIGHTS} (an unfinished run); export one of its "
                f"checkpoints: {path}/{CHECKPOINTS}/step-N"
            )
        return path
    run = path.parent.parent
    if path.is_dir() and path.parent.name == CHECKPOINTS and (run / rundir.CONFIG).is_file():
        return run
    raise UserError(
        f"{path} is neither a paratrain run directory nor one of its checkpoints "
        f"(RUN/{CHECKPOINTS}/step-N): export rebuilds the model from the run's {rundir.CONFIG}"
    )


def _full_disk(exc: OSError, target: Path) -> str:
    """One line: the file, how much it needs and is free, what to do."""
    figures = full_figures(exc, target.parent)
    before = "; the file there before is intact" if target.exists() else ""
    return (
        f"{full_headline(exc.errno)} while writing {target}: {figures}{before}; "
        f"{make_room(exc.errno)} or pass --out FILE on another disk"
    )


def _weight_layers(model: nn.Module) -> int:
    return sum(
        1
        for module in model.modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor) and not list(module.children())
    )


def _checked(
    source: str | Path, scheme: str, out: str | Path | None, overwrite: bool, repeats: int
) -> tuple[Path, Path]:
    """The run directory and the file to write, or ``UserError`` naming the first thing
    wrong; a missing extra is reported before any data is read."""
    if scheme not in SCHEMES:
        raise UserError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    run_dir = locate_run(source)
    target = Path(out) if out is not None else run_dir / run_files.export_name(scheme)
    if target.is_dir():
        raise UserError(f"--out {target} is a directory; name a file")
    if target.exists() and not overwrite:
        raise UserError(f"--out {target} exists; pass --overwrite to replace it")
    if not target.parent.is_dir():
        raise UserError(f"--out {target}: no folder {target.parent}")
    reason = int4_unsupported() if scheme == "int4" else None
    if reason is not None:
        raise UserError(reason)
    import_torchao()
    return run_dir, target


def export_model(
    source: str | Path,
    scheme: str = "int8",
    out: str | Path | None = None,
    overwrite: bool = False,
    data_dir: str | None = None,
    repeats: int = 20,
) -> ExportReport:
    """Quantize the model of the run at ``source``, write it to ``out``, measure both."""
    run_dir, target = _checked(source, scheme, out, overwrite, repeats)
    try:
        config = dict(json.loads((run_dir / rundir.CONFIG).read_text(encoding="utf-8"))["config"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{run_dir / rundir.CONFIG} is not a paratrain run configuration") from None
    if data_dir is not None:
        config["data_dir"] = data_dir
    cfg = settings_from(config)
    recipe = get_recipe(cfg.recipe)
    model = recipe.build_model(cfg)
    load_weights(model, source)
    model.eval()
    _, test_set = recipe.build_data(cfg)
    batch_size = cfg.batch_size or recipe.batch_size
    device = device_for(scheme)
    sample = next(iter(DataLoader(test_set, batch_size=batch_size)))[0]
    loss_fn = recipe.build_loss()

    def figures(name: str, net: nn.Module, size: int) -> Figures:
        loss, accuracy = evaluate(net, test_set, loss_fn, recipe.classification, batch_size, device)
        median, low, high = latency(net, sample, device, repeats)
        return Figures(name, size, loss, accuracy, median, low, high)

    model.to(device)
    before = figures("float32", model, saved_bytes(model))
    layers = quantizable(model)
    quantized = quantize(copy.deepcopy(model), scheme)
    try:
        save_quantized(target, quantized, scheme, config, torchao_version())
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        raise UserError(_full_disk(exc, target)) from None
    after = figures(scheme, quantized, target.stat().st_size)
    reloaded = load_quantized(target, map_location=device)
    with torch.inference_mode():
        x = sample.to(device, next(quantized.parameters()).dtype)
        reload_matches = torch.equal(reloaded(x), quantized(x))
    notes = []
    if scheme == "int8":
        int4 = int4_unsupported()
        notes.append(f"--int4 is not available here: {int4}" if int4 else "")
    return ExportReport(
        source=str(source),
        recipe=cfg.recipe,
        scheme=scheme,
        description=DESCRIPTIONS[scheme],
        out=str(target),
        device=str(device),
        batch_size=batch_size,
        repeats=repeats,
        before=before,
        after=after,
        quantized_layers=layers,
        weight_layers=_weight_layers(model),
        reload_matches=reload_matches,
        torchao=torchao_version(),
        notes=[n for n in notes if n],
    )
