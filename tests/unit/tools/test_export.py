"""`paratrain export --int8` and `paratrain.load_quantized` on real trained runs."""

from __future__ import annotations

import errno
import io
import json
import sys
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.cli.main import main
from paratrain.data.digits import load_digits_split
from paratrain.tools.export.artifact import FORMAT
from paratrain.tools.export.torchao_api import SCHEMES
from paratrain.training import run_files
from paratrain.utils.errors import UserError

pytest.importorskip("torchao")
CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.slow  # every test quantizes a trained run


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("export") / "digits"
    argv = ["train", "--strategy", "cpu", "--epochs", "3", "--no-progress", "--out", str(run)]
    assert main(argv) == 0
    return run


def _export(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["export", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_int8_export_report_and_reload(
    digits_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "digits-int8.pt"
    code, text, _ = _export(capsys, str(digits_run), "--int8", "--out", str(out), "--json")
    assert code == 0
    report = json.loads(text)
    before, after = report["before"], report["after"]
    assert report["quantized_layers"] == ["classifier.1", "classifier.3"]
    assert report["weight_layers"] == 4  # two convolutions stay float
    assert after["file_bytes"] == out.stat().st_size < before["file_bytes"] / 2
    assert before["test_accuracy"] > 0.8
    assert abs(after["test_accuracy"] - before["test_accuracy"]) < 0.05
    assert after["latency_seconds"] > 0 and report["reload_matches"] is True
    if not CUDA:
        assert any("--int4 is not available here" in note for note in report["notes"])

    model = paratrain.load_quantized(out)  # the documented call
    assert not model.training
    assert type(model.classifier[1].weight).__name__ == "Int8Tensor"
    assert type(model.features[0].weight) is torch.nn.Parameter
    x, y = load_digits_split()[1].tensors
    with torch.inference_mode():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy == pytest.approx(after["test_accuracy"])


def test_table_and_overwrite(digits_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text, _ = _export(capsys, str(digits_run), "--int8", "--repeats", "3")
    assert code == 0
    assert "float32" in text and "int8" in text and "load_quantized" in text
    assert (digits_run / "model-int8.pt").is_file()
    # the names `train --overwrite` removes are the names export writes
    assert run_files.EXPORT_SCHEMES == SCHEMES and run_files.export_name("int8") == "model-int8.pt"
    code, _, err = _export(capsys, str(digits_run), "--int8")
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1
    assert _export(capsys, str(digits_run), "--int8", "--overwrite", "--repeats", "2")[0] == 0


def test_a_full_disk_keeps_the_previous_export(
    digits_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk that fills up while the quantized model is written: one line naming the file
    and what to do, exit 2, the file replaced by --overwrite still whole, no leftover."""
    out = tmp_path / "q.pt"
    out.write_bytes(b"the previous export")

    real = torch.save

    def full(obj: object, path: Path | io.BytesIO) -> None:
        if isinstance(path, io.BytesIO):  # the size measured in memory
            return real(obj, path)
        Path(path).write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    argv = ("--int8", "--out", str(out), "--overwrite", "--repeats", "1")
    code, _, err = _export(capsys, str(digits_run), *argv)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"paratrain: error: no space left on device while writing {out}: ")
    assert "bytes free are needed; the file there before is intact" in err
    assert err.endswith("free space on that disk or pass --out FILE on another disk\n")
    assert out.read_bytes() == b"the previous export" and list(tmp_path.iterdir()) == [out]


def test_export_a_checkpoint(
    digits_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = sorted((digits_run / "checkpoints").iterdir())[0]
    out = tmp_path / "step.pt"
    code, text, _ = _export(capsys, str(step), "--int8", "--out", str(out), "--json")
    assert code == 0 and json.loads(text)["source"] == str(step)
    assert out.is_file()


def test_regression_recipe_reports_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "linear"
    argv = ["train", "--recipe", "linear", "--strategy", "cpu", "--epochs", "2"]
    assert main([*argv, "--no-progress", "--out", str(run)]) == 0
    capsys.readouterr()
    code, text, _ = _export(capsys, str(run), "--int8", "--json", "--repeats", "2")
    report = json.loads(text)
    assert code == 0 and report["after"]["test_accuracy"] is None
    assert report["after"]["test_loss"] == pytest.approx(report["before"]["test_loss"], rel=0.2)


@pytest.mark.skipif(CUDA, reason="this machine has a CUDA GPU")
def test_int4_without_cuda_says_why(digits_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _export(capsys, str(digits_run), "--int4")
    assert code == 2 and "needs a CUDA GPU" in err and err.count("\n") == 1


def test_bad_sources_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "w.pt"
    torch.save({"weight": torch.zeros(1)}, weights)
    for source in (tmp_path / "missing", weights, tmp_path):
        code, _, err = _export(capsys, str(source), "--int8")
        assert code == 2 and "run directory" in err and err.count("\n") == 1
    code, _, err = _export(capsys, str(tmp_path))
    assert code == 2 and "--int8" in err


def test_missing_torchao_says_how_to_install(
    digits_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    code, _, err = _export(capsys, str(digits_run), "--int8", "--out", "never.pt")
    assert code == 2 and 'pip install "paratrain[export]"' in err and err.count("\n") == 1


class Payload:
    """Not a type torch.load(weights_only=True) may build."""


def test_load_quantized_refuses_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "state_dict": {}, "extra": Payload()}, path)
    with pytest.raises(UserError, match="refused"):
        paratrain.load_quantized(path)
    torch.save({"weight": torch.zeros(1)}, path)
    with pytest.raises(UserError, match="not a model written by paratrain export"):
        paratrain.load_quantized(path)
