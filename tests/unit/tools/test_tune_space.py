"""`--space` and the checks of a search: everything found before Ray is needed."""

from __future__ import annotations

import pytest

from paratrain.tools.tune.settings import TUNABLE, Resources, TuneSettings, checked
from paratrain.tools.tune.space import parse_dimension, parse_space
from paratrain.training.config import TrainConfig
from paratrain.utils.errors import UserError


def test_every_distribution_parses_without_eval() -> None:
    space = parse_space(
        [
            "lr=loguniform(1e-3, 1e-1)",
            "batch_size=choice(32,64,128)",
            "precision=grid(32, bf16)",
            "seed=randint(0,10)",
            "accumulate=lograndint(1,9)",
            "cifar_stem=choice(True,False)",
        ],
        TUNABLE,
    )
    assert [(d.name, d.distribution, d.args) for d in space] == [
        ("lr", "loguniform", (1e-3, 1e-1)),
        ("batch_size", "choice", (32, 64, 128)),
        ("precision", "grid", ("32", "bf16")),
        ("seed", "randint", (0, 10)),
        ("accumulate", "lograndint", (1, 9)),
        ("cifar_stem", "choice", (True, False)),
    ]
    assert parse_dimension("batch-size=choice(8)", TUNABLE).name == "batch_size"
    assert parse_dimension("lr=quniform(0.01,0.1,0.01)").corners() == (0.01, 0.1)
    assert parse_dimension("seed=randint(0,10)").corners() == (0, 9)  # upper bound excluded
    assert parse_dimension("opt=choice('adam', \"sgd, nesterov\")").args == (
        "adam",
        "sgd, nesterov",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr=loguniform(1e-3", "expected NAME=DISTRIBUTION(ARGS)"),
        ("lr", "expected NAME=DISTRIBUTION(ARGS)"),
        ("lr=gauss(0,1)", "unknown distribution 'gauss'; valid: uniform(low, high)"),
        ("momentum=uniform(0,1)", "cannot tune 'momentum'; tunable: lr, batch_size"),
        ("lr=uniform(0.1)", "uniform takes 2 numbers (low, high)"),
        ("lr=uniform(0.1,0.01)", "the lower bound must be below the upper one"),
        ("lr=loguniform(0,0.1)", "loguniform needs a positive lower bound"),
        ("lr=choice()", "choice needs at least one value"),
        ("lr=choice(__import__('os'))", "is not a number, string or True/False"),
        ("lr=choice([1,2])", "is not a number, string or True/False"),
        ("batch_size=uniform(16,64)", "batch_size is an integer: use randint"),
        ("batch_size=randint(16.0,64)", "randint takes integers"),
        ("precision=uniform(1,2)", "precision takes listed values"),
        ("cifar_stem=choice(1,0)", "cifar_stem takes True or False"),
    ],
)
def test_a_malformed_space_is_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(UserError) as caught:
        parse_space([text], TUNABLE)
    assert str(caught.value).startswith(f"--space {text!r}: ")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(UserError, match="lr is given twice"):
        parse_space(["lr=choice(0.1)", "lr=choice(0.2)"], TUNABLE)


def _settings(**changes: object) -> TuneSettings:
    values: dict[str, object] = {
        "base": TrainConfig(recipe="digits", strategy="cpu", epochs=2),
        "space": ["lr=loguniform(1e-3,1e-1)"],
        "resources": Resources(1.0, 0.0),
    }
    values.update(changes)
    return TuneSettings(**values)  # type: ignore[arg-type]


def test_checked_settings_fill_the_metric_and_mode_from_the_recipe() -> None:
    digits = checked(_settings())
    assert (digits.metric, digits.mode, digits.base.batch_size) == ("eval_accuracy", "max", 32)
    linear = checked(_settings(base=TrainConfig(recipe="linear", strategy="cpu")))
    assert (linear.metric, linear.mode) == ("eval_loss", "min")
    assert checked(_settings(metric="train_loss")).mode == "min"
    again = TuneSettings.from_dict(digits.to_dict())
    assert again == digits


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"metric": "eval_acc"}, "--metric eval_acc: recipe digits reports eval_accuracy, "),
        (
            {"base": TrainConfig(recipe="linear"), "metric": "eval_accuracy"},
            "recipe linear reports eval_loss, train_loss",
        ),
        ({"mode": "best"}, "--mode best: choose min or max"),
        ({"scheduler": "pbt"}, "--scheduler pbt: choose one of asha, fifo"),
        ({"search": "bayes"}, "--search bayes: choose one of random, optuna"),
        ({"trials": 0}, "--trials must be at least 1"),
        ({"space": []}, "give at least one --space"),
        ({"space": ["lr=uniform(0,0.1)"]}, "lr=0: --lr must be a positive number"),
        ({"space": ["batch_size=choice(0,32)"]}, "batch_size=0: --batch-size must be at least 1"),
        ({"space": ["precision=choice(fp8)"]}, "unknown precision 'fp8'"),
        ({"search": "optuna", "space": ["lr=grid(0.1,0.2)"]}, "use it with --search random"),
    ],
)
def test_bad_settings_are_refused_before_ray(changes: dict[str, object], message: str) -> None:
    with pytest.raises(UserError) as caught:
        checked(_settings(**changes))
    assert message in str(caught.value)


def test_the_number_of_trials_counts_every_grid_combination() -> None:
    settings = _settings(space=["lr=grid(0.1,0.2)", "precision=grid(32,bf16,fp16)"], trials=2)
    assert settings.total_trials() == 12


def test_resources_default_to_what_the_strategy_uses() -> None:
    assert Resources.for_config(TrainConfig(strategy="cpu"), None, None) == Resources(1.0, 0.0)
    ddp = TrainConfig(strategy="ddp", devices="cpu,cpu")
    assert Resources.for_config(ddp, None, None) == Resources(2.0, 0.0)
    assert Resources.for_config(ddp, 4, None) == Resources(4.0, 0.0)
