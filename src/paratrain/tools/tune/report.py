"""``OUT/tune.json``: the search's settings, written when it starts (``--resume`` reads them
back), then every trial and the best one when it ends. Never replaced without --overwrite."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from paratrain.tools.tune.engine import RAY_DIR
from paratrain.tools.tune.outcome import BEST
from paratrain.tools.tune.settings import TuneSettings
from paratrain.tools.tune.trial import TRIALS
from paratrain.training import rundir
from paratrain.utils.atomic import atomic_write_text
from paratrain.utils.errors import UserError

TUNE_JSON = "tune.json"
TUNE_PNG = "tune.png"
SCHEMA_VERSION = 1
_OWN = (TUNE_JSON, TUNE_PNG, TRIALS, RAY_DIR, BEST)


def default_out(recipe: str) -> Path:
    return Path("runs") / f"tune-{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_out(out: str | None, recipe: str, overwrite: bool) -> Path:
    """Check and create ``--out``; a search already there is refused unless ``overwrite``,
    which removes only the search's own files."""
    directory = Path(out) if out is not None else default_out(recipe)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory} is a file, not a directory; choose another --out")
    if (directory / TUNE_JSON).exists():
        if not overwrite:
            raise UserError(
                f"--out {directory} already holds a search ({TUNE_JSON}); continue it with "
                f"--resume {directory}, pass --overwrite to replace it, or choose another --out"
            )
        for name in _OWN:
            path = directory / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {directory}: {exc.strerror}") from None
    return directory


def read_report(out: Path) -> dict[str, Any]:
    path = out / TUNE_JSON
    if not path.is_file():
        raise UserError(f"--resume {out}: no {TUNE_JSON} there; pass the --out of a search")
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        TuneSettings.from_dict(data["settings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--resume {out}: {TUNE_JSON} is unreadable ({exc})") from None
    return data


def write_report(out: Path, report: dict[str, Any]) -> Path:
    path = out / TUNE_JSON
    text = json.dumps(report, indent=2, allow_nan=False) + "\n"
    atomic_write_text(path, text)
    return path


def start_report(settings: TuneSettings, address: str | None) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "running",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": settings.to_dict(),
        "ray": {"address": address or "local", "experiment": RAY_DIR, "version": _ray_version()},
        "versions": rundir.versions(),
        "trials": [],
        "best": None,
    }


def _ray_version() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    return str(ray.__version__)
