"""``--recipe timm:NAME`` without timm's models at work: where timm is missing the command
says what to install in one line; the images it trains on; a name timm does not know."""

from __future__ import annotations

import sys

import pytest
import torch

from paratrain.cli.main import main
from paratrain.training.recipes import get_recipe
from paratrain.training.timm_recipe import IMAGE_SIZE, _digits_at_size
from paratrain.utils.errors import UserError


def test_without_timm_the_recipe_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm fails, as where it is missing
    with pytest.raises(UserError, match=r"needs timm .*pip install 'paratrain\[timm\]'"):
        get_recipe("timm:resnet18")
    assert main(["train", "--recipe", "timm:resnet18", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'paratrain[timm]'" in err and err.count("\n") == 1


def test_the_recipe_trains_on_the_shipped_digits_at_32_pixels_in_three_channels() -> None:
    train, test = _digits_at_size(None)  # type: ignore[arg-type]  # reads no setting
    images, labels = train.tensors
    assert images.shape == (1437, 3, IMAGE_SIZE, IMAGE_SIZE) and len(test) == 360
    assert torch.equal(images[:, 0], images[:, 2]) and images.min() == -1 and images.max() == 1
    assert sorted(labels.unique().tolist()) == list(range(10))


def test_a_name_timm_does_not_know_is_one_line() -> None:
    pytest.importorskip("timm")
    with pytest.raises(UserError, match="timm has no model 'no_such_net'; python -c"):
        get_recipe("timm:no_such_net")
