"""Key names across layouts (paratrain.checkpoints.files.keys), as pure functions: no model, no
process (runs on `--strategy cpu`). The loading tests in test_load_weights.py go through
them; these pin each rule so that a changed prefix count or tie-break fails here."""

from __future__ import annotations

import pytest

from paratrain.checkpoints.files.keys import (
    _majority_prefixes,
    canonical_maps,
    common_prefix,
    describe_rename,
    drop_wrapper_segments,
    find_rename,
    prefix_counts,
    rename,
    wrapper_chain,
)


def test_wrapper_segments_are_dropped_anywhere() -> None:
    assert drop_wrapper_segments("module.enc._orig_mod.w") == "enc.w"
    assert drop_wrapper_segments("enc.modules.w") == "enc.modules.w"


def test_canonical_maps_fall_back_to_a_form_where_no_key_collides() -> None:
    # dropping every wrapper segment would make these one key; stripping leading ones does not
    src, dst = canonical_maps(["a.module.w", "a.w"], ["a.w"])
    assert src == {"a.module.w": "a.module.w", "a.w": "a.w"}
    assert dst == {"a.w": "a.w"}
    # a collision on the target's side alone is enough to fall back, down to the names as is
    src, dst = canonical_maps(["fc.w"], ["module.w", "w"])
    assert dst == {"module.w": "module.w", "w": "w"}
    assert src == {"fc.w": "fc.w"}
    # no collision: the most forgiving form
    src, dst = canonical_maps(["module.enc._orig_mod.w"], ["enc.w"])
    assert src == {"enc.w": "module.enc._orig_mod.w"} and dst == {"enc.w": "enc.w"}


def test_wrapper_chain_is_the_leading_wrappers() -> None:
    assert wrapper_chain("module._orig_mod.fc.w") == "module._orig_mod."
    assert wrapper_chain("fc.module.w") == ""


def test_common_prefix_leaves_each_key_a_name() -> None:
    assert common_prefix(["model.a.w", "model.a.b"]) == "model.a."
    assert common_prefix(["model.w", "model.x.y"]) == "model."  # keys of unequal depth
    assert common_prefix(["a.w", "b.w"]) == ""
    assert common_prefix(["model.a.w"]) == ""  # one key explains nothing
    assert common_prefix([]) == ""


def test_prefix_counts_lists_wrapper_chains_then_a_shared_prefix() -> None:
    keys = ["module.model.a", "module.model.b", "_orig_mod.model.c"]
    assert list(prefix_counts(keys).items()) == [("module.", 2), ("_orig_mod.", 1), ("model.", 3)]
    assert prefix_counts(["a.w", "b.w"]) == {}


def test_rename_replaces_a_leading_prefix_and_refuses_collisions() -> None:
    assert rename(["a.x", "a.y", "b.a.z"], "a.", "c.") == {
        "c.x": "a.x",
        "c.y": "a.y",
        "b.a.z": "b.a.z",
    }
    assert rename(["model.w", "w"], "model.", "") is None


def test_majority_prefixes_count_up_to_three_segments_held_by_half_the_keys() -> None:
    keys = ["a.b.c.d.w", "a.b.x", "z"]  # a.: 2, a.b.: 2, a.b.c.: 1 of 3; a.b.c.d. too deep
    assert _majority_prefixes(keys) == ["a.", "a.b."]
    assert _majority_prefixes(["a.w", "b.w"]) == ["a.", "b."]  # exactly half counts
    assert _majority_prefixes(["a.b.c.d.w", "a.b.c.d.v"]) == ["a.", "a.b.", "a.b.c."]
    assert _majority_prefixes(["a.b.c.d.w", "a.b.c.d.v"], depth=4)[-1] == "a.b.c.d."
    assert _majority_prefixes(["a.w", "b.x.w", "c.x.w"]) == []  # each prefix counted once


def test_find_rename_removes_adds_or_renames_a_prefix() -> None:
    shapes = {"fc.w": (2, 3), "fc.b": (2,)}
    lightning = {f"model.{k}": v for k, v in shapes.items()}
    assert find_rename(lightning, shapes) == ("model.", "")
    assert find_rename(shapes, lightning) == ("", "model.")
    net = {f"net.{k}": v for k, v in shapes.items()}
    body = {f"body.{k}": v for k, v in shapes.items()}
    assert find_rename(net, body) == ("net.", "body.")


def test_find_rename_needs_keys_missing_on_both_sides_and_a_better_match() -> None:
    shapes = {"fc.w": (2, 3), "fc.b": (2,)}
    assert find_rename(shapes, shapes) is None
    assert find_rename(shapes, {"fc.w": (2, 3)}) is None  # nothing missing
    assert find_rename({"fc.w": (2, 3)}, shapes) is None  # nothing unexpected
    # every checkpoint key is a model key: its names stand, even where a prefix would
    # match a shape that the name as it is does not
    assert find_rename({"w": (2,)}, {"w": (1,), "m.w": (2,)}) is None
    # no prefix explains u -> v: loading the names as they are is as good as it gets
    assert find_rename({"w": (1,), "u": (2,)}, {"w": (1,), "v": (2,)}) is None


def test_find_rename_prefers_matching_shapes_over_matching_names() -> None:
    # renaming a. -> b. and a. -> c. match the same number of names; only b. matches shapes
    source = {"a.w": (2,), "a.v": (3,)}
    target = {"c.w": (5,), "c.v": (5,), "b.w": (2,), "b.v": (3,)}
    assert find_rename(source, target) == ("a.", "b.")
    target = {"b.w": (5,), "b.v": (5,), "c.w": (2,), "c.v": (3,)}
    assert find_rename(source, target) == ("a.", "c.")


def test_find_rename_keeps_the_first_of_equal_matches() -> None:
    # a rename that matches no more than the names as they are is not proposed
    source = {"w": (1,), "a.x": (2,)}
    target = {"w": (1,), "b.y": (2,)}
    assert find_rename(source, target) is None


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        (
            "model.",
            "",
            "removed the prefix 'model.' that the checkpoint's keys carry"
            " (the LightningModule attribute?)",
        ),
        ("net.", "", "removed the prefix 'net.' that the checkpoint's keys carry"),
        ("", "net.", "added the prefix 'net.' that the model's keys carry"),
        ("net.", "body.", "renamed the checkpoint's prefix 'net.' to 'body.'"),
    ],
)
def test_describe_rename(old: str, new: str, said: str) -> None:
    assert describe_rename(old, new) == said
