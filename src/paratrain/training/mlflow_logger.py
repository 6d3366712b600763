"""``--mlflow [URI]``: the run's parameters, metrics and final weights in MLflow.

Written by the main process through ``MlflowClient`` (no global active run, so a user's own
MLflow runs are left alone). ``URI`` is a tracking URI or a folder; the default is
``mlruns/`` in the working directory: MLflow's file store, which MLflow 3 keeps in
maintenance mode and refuses unless ``MLFLOW_ALLOW_FILE_STORE`` is set (paratrain sets it for
a folder it is given; a database such as ``sqlite:///mlflow.db`` needs no such thing). Needs
``pip install 'paratrain[mlflow]'``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paratrain.utils import environment
from paratrain.utils.errors import UserError

#: the experiment paratrain's runs are logged under
EXPERIMENT = "paratrain"
DEFAULT_URI = "mlruns"
MISSING = "--mlflow needs MLflow: pip install 'paratrain[mlflow]'"


def require_mlflow() -> None:
    """``UserError`` naming the extra to install when MLflow is missing."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise UserError(MISSING) from None


def tracking_uri(uri: str) -> str:
    """A folder becomes a ``file:`` URI (absolute: the run may change directory)."""
    if "://" in uri or (":" in uri and not uri.startswith("file:")):
        return uri  # a server or a database
    return Path(uri.removeprefix("file:")).resolve().as_uri()


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif value is not None:
            flat[f"{prefix}{key}"] = str(value)[:500]  # MLflow's limit for a value
    return flat


class MlflowLogger:
    """One MLflow run: ``log_params`` once, ``log`` metrics by step, ``finish`` with files."""

    def __init__(self, uri: str, run_name: str) -> None:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(uri)
        if uri.startswith("file:"):  # the local folder asked for, not a database
            environment.set_default("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(EXPERIMENT)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = [Param(key, value) for key, value in _flatten(params).items()]
        for start in range(0, len(flat), 100):  # MLflow takes 100 parameters per batch
            self.client.log_batch(self.run_id, params=flat[start : start + 100])

    def log(self, values: Mapping[str, float | int | None], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [
            Metric(key, float(value), stamp, step)
            for key, value in values.items()
            if isinstance(value, (int, float))
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, files: list[Path], status: str = "FINISHED") -> None:
        for path in files:
            if path.exists():
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status)
