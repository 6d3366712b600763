"""One configuration: each runtime option is declared once (paratrain.runtime.config), and
``Runtime(...)``, ``TrainConfig`` and `paratrain train`'s flags agree with the declarations;
strategies carry the options only they read (paratrain.strategies.choices)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import pickle

import pytest

import paratrain
from paratrain.cli.commands.train import config_from_args
from paratrain.cli.main import build_parser
from paratrain.runtime.config import RuntimeConfig, command_line_options, runtime_keywords
from paratrain.runtime.speed import SpeedOptions
from paratrain.strategies import (
    DDP,
    FLAT_OWNERS,
    FSDP,
    Pipeline,
    Strategy,
    build_strategy,
    choose,
)
from paratrain.strategies import ddp as ddp_module
from paratrain.training.config import TrainConfig
from paratrain.utils.errors import UserError

#: `paratrain train`'s options that are not the runtime's: what a run trains and writes,
#: how its processes start (paratrain.launching), and --help
TRAIN_ONLY = {
    "help",
    "recipe",
    "epochs",
    "batch_size",
    "lr",
    "max_steps",
    "data_dir",
    "download",
    "synthetic",
    "cifar_stem",
    "out",
    "overwrite",
    "fresh",
    "resume",
    "no_progress",
    "save_every",
    "keep",
    "data_path",
    "device_budget_gib",
    "tensorboard",
    "mlflow",
    "profile",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "max_restarts",
    "requeue",
}


@pytest.fixture(autouse=True)
def _no_run_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PARATRAIN_STRATEGY", "PARATRAIN_DEVICES", "PARATRAIN_NONFINITE"):
        monkeypatch.delenv(name, raising=False)


def _train_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            parser = action.choices["train"]
            assert isinstance(parser, argparse.ArgumentParser)
            return parser
    raise AssertionError("paratrain has no train command")


def _declared_flags() -> dict[str, str]:
    """Declared flag -> the Runtime keyword it sets."""
    flags = {}
    for spec in [*dataclasses.fields(RuntimeConfig), *dataclasses.fields(SpeedOptions)]:
        if spec.metadata.get("flag"):
            flags[spec.metadata["flag"]] = spec.name
    for flat in FLAT_OWNERS:  # the strategies' flat keywords keep their flags
        flags["--" + flat.replace("_", "-")] = flat
    return flags


def test_runtime_keywords_are_the_declared_options() -> None:
    parameters = list(inspect.signature(paratrain.Runtime.__init__).parameters)[1:]
    assert sorted(parameters) == sorted(name for name, _, _ in runtime_keywords())


def test_runtime_defaults_build_the_default_configuration() -> None:
    signature = inspect.signature(paratrain.Runtime.__init__)
    defaults = {name: p.default for name, p in signature.parameters.items() if name != "self"}
    assert RuntimeConfig.of(**defaults) == RuntimeConfig()


def test_every_declared_flag_is_an_option_of_train_and_back() -> None:
    parser = _train_parser()
    options = {flag for action in parser._actions for flag in action.option_strings}
    declared = _declared_flags()
    assert sorted(set(declared) - options) == []
    keywords = {name for name, _, _ in runtime_keywords()}
    for action in parser._actions:
        if action.dest in keywords:  # sets a runtime option: under its declared flag
            names = {declared.get(flag) for flag in action.option_strings}
            assert action.dest in names, action.option_strings
        else:
            runtime_flag = [flag for flag in action.option_strings if flag in declared]
            assert runtime_flag or action.dest in TRAIN_ONLY, (
                f"{action.option_strings} is neither declared in RuntimeConfig nor one of "
                "train's own options (TRAIN_ONLY)"
            )


def test_every_runtime_option_of_train_reaches_the_runtime_through_train_config() -> None:
    """A runtime option needs no field in TrainConfig: set on `paratrain train`'s command
    line, it reaches the run's RuntimeConfig (and config.json, flat) all the same."""
    parser = _train_parser()
    args = parser.parse_args(["--agreement-seconds", "2.5"])
    cfg = config_from_args(args)
    assert "agreement_seconds" not in {f.name for f in dataclasses.fields(TrainConfig)}
    assert cfg.runtime_options == {"agreement_seconds": 2.5}
    assert cfg.runtime_config().agreement_seconds == 2.5
    assert cfg.to_dict()["agreement_seconds"] == 2.5
    assert TrainConfig.of(**cfg.to_dict()) == cfg  # config.json back, as --resume reads it
    assert cfg.option("agreement_seconds") == 2.5
    assert TrainConfig().option("agreement_seconds") == RuntimeConfig().agreement_seconds


def test_unknown_settings_are_refused_as_unknown_keywords() -> None:
    with pytest.raises(TypeError, match="unknown settings: not_an_option"):
        TrainConfig.of(recipe="linear", not_an_option=1)


def test_generated_flags_take_the_declared_help() -> None:
    by_dest = {action.dest: action for action in _train_parser()._actions}
    for flag, kwargs in command_line_options():
        action = by_dest[kwargs["dest"]]
        assert flag in action.option_strings
        assert action.help == kwargs["help"]


def test_strategy_objects_carry_their_options() -> None:
    choice = paratrain.strategies.FSDP(blocks="Block, Head")
    assert choice == FSDP(blocks=("Block", "Head"))
    rt = paratrain.Runtime(strategy=FSDP(blocks=["Block"]), devices="cpu,cpu")
    assert rt.config.strategy == FSDP(blocks=("Block",))
    assert rt.strategy.options.fsdp_blocks == ("Block",)
    pipeline = Pipeline(split="blocks.2", schedule="gpipe", microbatches=2)
    built = build_strategy(pipeline, "cpu,cpu")
    assert built.options.pipeline_split == ("blocks.2",)
    assert built.options.pipeline_schedule == "gpipe"
    assert built.options.pipeline_microbatches == 2
    config = RuntimeConfig(strategy=pipeline, devices="cpu,cpu")
    assert pickle.loads(pickle.dumps(config)) == config  # spawned processes rebuild from it


def test_names_and_flat_keywords_map_onto_the_strategy_objects() -> None:
    assert RuntimeConfig.of(strategy="fsdp", fsdp_blocks=("Block",)).strategy == FSDP(
        blocks=("Block",)
    )
    flat = RuntimeConfig.of(strategy="pipeline", pipeline_schedule="gpipe").strategy
    assert flat == Pipeline(schedule="gpipe")
    assert choose(FSDP(blocks=("A",)), fsdp_blocks=("A",)) == FSDP(blocks=("A",))
    assert RuntimeConfig(strategy="ddp").strategy == DDP()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"strategy": "ddp", "fsdp_blocks": ("Block",)},
            "--fsdp-blocks applies to --strategy fsdp only, not ddp; drop --fsdp-blocks or "
            "use --strategy fsdp",
        ),
        (
            {"strategy": FSDP(), "pipeline_microbatches": 2},
            "--pipeline-microbatches applies to --strategy pipeline only, not fsdp",
        ),
        ({"strategy": FSDP(blocks=("A",)), "fsdp_blocks": ("B",)}, "disagree: give it once"),
        ({"strategy": "pipeline", "pipeline_schedule": "zigzag"}, "use one of 1f1b, gpipe"),
    ],
)
def test_an_option_the_strategy_does_not_read_is_refused_in_one_line(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(UserError) as caught:
        paratrain.Runtime(**kwargs)  # type: ignore[arg-type]
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_num_processes_builds_no_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Strategy, *args: object, **kwargs: object) -> None:
        raise AssertionError("a strategy was built to count processes")

    monkeypatch.setattr(Strategy, "__init__", refuse)
    assert RuntimeConfig(strategy=DDP(), devices="cpu,cpu,cpu").num_processes == 3
    assert RuntimeConfig(strategy=FSDP(), devices="cpu,cpu").num_processes == 2
    # a count is of GPUs where the machine has some (cuda:1 may not exist): here, of CPUs
    monkeypatch.setattr(ddp_module, "cuda_count", lambda: 0)
    assert RuntimeConfig(strategy=FSDP(), devices="2").num_processes == 2
    assert RuntimeConfig(strategy="cpu").num_processes == 1  # type: ignore[arg-type]
    assert TrainConfig(strategy="pipeline", devices="cpu,cpu").runtime_config().num_processes == 2
    with pytest.raises(UserError, match="at least 1"):
        RuntimeConfig(strategy=DDP(), devices="0").num_processes  # noqa: B018


def test_the_options_are_checked_when_the_configuration_is_built() -> None:
    with pytest.raises(UserError, match="--accumulate must be at least 1"):
        RuntimeConfig(accumulate=0)
    with pytest.raises(UserError, match="valid strategies"):
        RuntimeConfig(strategy="nope")  # type: ignore[arg-type]
    with pytest.raises(UserError, match="non-finite policy 'sometimes'"):
        RuntimeConfig(nonfinite="sometimes")


def test_the_nonfinite_default_is_read_from_the_environment_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PARATRAIN_NONFINITE", "skip")
    rt = paratrain.Runtime(strategy="cpu")
    monkeypatch.setenv("PARATRAIN_NONFINITE", "off")
    assert rt.config.nonfinite == "skip" and rt.nonfinite.policy == "skip"
    assert paratrain.Runtime.from_config(rt.config).nonfinite.policy == "skip"
    assert paratrain.Runtime(strategy="cpu", nonfinite="error").nonfinite.policy == "error"
