"""One vocabulary across the subcommands, every one explained in its --help, errors that
point at the right --help, and `paratrain tune` taking the options a trial can use. Nothing
here trains: the parsers and the checks before any process starts (``--strategy cpu``)."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.archives import good_archive
from safetensors.torch import save_file

from paratrain.cli.commands.tune import REFUSED, fetch_once, settings_from_args
from paratrain.cli.main import build_parser, main, parse
from paratrain.data.cifar import CIFAR_FILES, CIFAR_SUBDIR
from paratrain.data.download import MD5_ENV, URL_ENV
from paratrain.utils.errors import UserError

#: the one name of each idea, and spellings of the same ideas no parser may show
VOCABULARY = {"steps": "--steps", "devices": "--devices", "json": "--json", "out": "--out"}
OTHER_SPELLINGS = {"--batches", "--device", "--output", "--num-steps", "--iters", "--outdir"}


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every (sub)command's parser, named as its --help names it."""
    todo = [build_parser()]
    while todo:
        parser = todo.pop()
        yield parser.prog, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()
                listed = {choice.dest for choice in action._choices_actions if choice.help}
                assert listed == set(action.choices), f"{parser.prog}: a subcommand lacks help"


def shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and a.option_strings]


def test_every_subcommand_has_a_description_and_every_option_a_help_text() -> None:
    missing = []
    for prog, parser in parsers():
        if not parser.description:
            missing.append(f"{prog}: no description")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue  # each of its subcommands has a help line (checked in parsers())
            if action.help is None or not str(action.help).strip():
                missing.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
    assert missing == [], missing
    assert len(dict(parsers())) >= 15  # every subcommand, the nested ones too


def test_one_name_for_one_idea() -> None:
    for prog, parser in parsers():
        for action in shown(parser):
            assert not OTHER_SPELLINGS & set(action.option_strings), (prog, action.option_strings)
            if action.dest in VOCABULARY:
                assert VOCABULARY[action.dest] in action.option_strings, (prog, action.dest)


def test_old_spellings_still_work_unshown() -> None:
    args = parse(["bench", "loader", "--batches", "7", "--device", "cpu"])
    assert (args.steps, args.devices) == (7, "cpu")
    assert parse(["bench", "crossover", "--device", "mps"]).devices == "mps"
    slurm = ["slurm", "--nodes", "1", "--gpus-per-node", "1"]
    assert parse([*slurm, "--output", "a.sbatch"]).output == "a.sbatch"
    assert parse([*slurm, "-o", "b.sbatch"]).output == "b.sbatch"


def test_bench_options_before_a_micro_benchmark_apply_to_it_or_are_refused() -> None:
    args = parse(["bench", "--steps", "5", "--json", "--recipe", "linear", "loader"])
    assert (args.micro, args.steps, args.json, args.recipe) == ("loader", 5, True, "linear")
    assert parse(["bench", "--repeats", "4", "placement"]).repeats == 4  # its default is 10
    assert parse(["bench", "loader"]).steps == 30
    with pytest.raises(UserError, match=r"--strategies is an option of paratrain bench, not "):
        parse(["bench", "--strategies", "cpu", "loader"])
    with pytest.raises(UserError, match=r"--steps is given before and after loader"):
        parse(["bench", "--steps", "5", "loader", "--steps", "6"])


def test_a_micro_benchmark_measures_one_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "loader", "--devices", "cpu,cpu"]) == 2
    err = capsys.readouterr().err
    assert "paratrain bench loader measures one device" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["tune", "--bogus"], "paratrain tune"),
        (["train", "--strategy", "cpu", "--bogus", "1"], "paratrain train"),
        (["bench", "loader", "--bogus"], "paratrain bench loader"),
        (["ckpt", "inspect", "x", "--bogus"], "paratrain ckpt inspect"),
        (["train", "--seed"], "paratrain train"),
    ],
)
def test_errors_point_at_the_right_help(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"(see: {prog} --help)\n") and err.count("\n") == 1, err


def test_tune_takes_the_options_a_trial_can_use() -> None:
    argv = ["tune", "--strategy", "cpu", "--space", "lr=choice(0.1)", "--tensorboard"]
    argv += ["--save-every", "5", "--keep", "2", "--data-path", "loader", "--profile", "2"]
    argv += ["--max-steps", "10"]
    base = settings_from_args(parse(argv)).base
    assert (base.tensorboard, base.save_every, base.keep) == (True, 5, 2)
    assert (base.data_path, base.profile, base.max_steps) == ("loader", 2, 10)
    with pytest.raises(UserError, match="--save-every must be at least 1"):
        settings_from_args(parse([*argv, "--save-every", "0"]))


def test_tune_names_the_train_options_it_refuses_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "search"
    base = ["tune", "--space", "lr=choice(0.1)", "--out", str(out)]
    for flag, (is_flag, why) in REFUSED.items():
        assert main([*base, flag, *([] if is_flag else ["1"])]) == 2
        err = capsys.readouterr().err
        assert (
            err == f"paratrain: error: paratrain tune takes no {flag}: {why} "
            "(see: paratrain tune --help)\n"
        )
    assert main([*base, "--nnodes", "2", "--fresh"]) == 2
    err = capsys.readouterr().err
    assert "--fresh: a search starts over with --overwrite" in err and err.count("\n") == 1
    assert not out.exists()
    help_text = build_parser()._subparsers._group_actions[0].choices["tune"].format_help()
    assert "--tensorboard" in help_text and "--save-every" in help_text
    assert "except --fresh, --nnodes" in " ".join(help_text.split())


def test_ckpt_convert_takes_out_as_dst(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "w.safetensors"
    save_file({"weight": torch.ones(2)}, str(source))
    assert main(["ckpt", "convert", str(source), "--out", str(tmp_path / "a.pt")]) == 0
    assert (tmp_path / "a.pt").is_file()
    assert main(["ckpt", "convert", str(source)]) == 2
    assert main(["ckpt", "convert", str(source), "b.pt", "--out", "c.pt"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("paratrain: error: neither DST nor --out given")
    assert err[1].startswith("paratrain: error: both DST and --out given")


def test_tune_downloads_the_data_once_before_the_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--download`` is fetched by the command (as `paratrain train` does), so every trial
    reads the folder instead of finding no data (a local archive: file://)."""
    archive = tmp_path / "cifar.tar.gz"
    archive.write_bytes(good_archive(tmp_path / "src"))
    monkeypatch.setenv(URL_ENV, archive.as_uri())
    monkeypatch.setenv(MD5_ENV, hashlib.md5(archive.read_bytes()).hexdigest())
    argv = ["tune", "--recipe", "cifar10-resnet18", "--download", "--strategy", "cpu"]
    settings = settings_from_args(parse([*argv, "--data-dir", "data", "--space", "lr=choice(0.1)"]))
    assert settings.base.data_dir == str(Path("data").resolve())  # absolute for the trials
    monkeypatch.chdir(tmp_path)
    settings = settings_from_args(parse([*argv, "--data-dir", "data", "--space", "lr=choice(0.1)"]))
    fetch_once(settings)
    assert settings.base.data_dir == str(tmp_path / "data" / CIFAR_SUBDIR)
    assert sorted(p.name for p in Path(settings.base.data_dir).iterdir()) == sorted(CIFAR_FILES)


def test_recipes_speaks_json_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes", "--json"]) == 0
    recipes = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in recipes if r["default"]] == ["digits"]
    assert {"name", "description", "epochs", "batch_size", "lr"} <= set(recipes[0])
