"""The check before each collective every rank must make: what a call's fingerprint tells
apart, and the message the ranks stop with. No devices, no processes: the calls are
described here as each rank would (the two-process runs are in
tests/integration/test_collective_mismatch.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.runtime.call_check import (
    MAX_DIMS,
    SHUFFLE,
    Call,
    mismatch_message,
)


def _all_reduce(tensor: torch.Tensor, op: str = "sum") -> Call:
    return Call.of("rt.all_reduce", tensor, op=op)


def test_a_fingerprint_tells_apart_what_cannot_be_paired() -> None:
    base = _all_reduce(torch.ones(2, 3))
    others = [
        _all_reduce(torch.ones(2, 3, dtype=torch.int32)),  # dtype
        _all_reduce(torch.ones(3, 2)),  # shape, same number of elements
        _all_reduce(torch.ones(6)),  # dimensions
        _all_reduce(torch.ones(2, 3), op="max"),  # reduce op
        Call.of("rt.all_gather", torch.ones(2, 3)),  # the call
        Call.of("rt.barrier"),
        Call.of("rt.save"),
        Call.of(SHUFFLE),
    ]
    prints = {call.fingerprint() for call in [base, *others]}
    assert len(prints) == len(others) + 1
    assert all(0 <= p < 2**52 for p in prints)  # exact in the agreement's float64 slots
    # the same call on another rank, whatever its own count of collectives
    assert dataclasses.replace(base, number=9).fingerprint() == base.fingerprint()
    broadcasts = [Call.of("rt.broadcast_object", src=src) for src in (0, 1)]
    assert broadcasts[0].fingerprint() != broadcasts[1].fingerprint()


def test_a_call_travels_as_a_fixed_number_of_integers() -> None:
    for call in [
        _all_reduce(torch.ones(2, 3)),
        Call.of("rt.all_gather", torch.ones(())),
        Call.of("rt.broadcast_object", src=1),
        dataclasses.replace(Call.of("rt.all_gather", torch.ones([1] * 10)), number=4),
    ]:
        assert len(call.vector()) == 6 + MAX_DIMS
        assert Call.from_vector(call.vector()) == call


@pytest.mark.parametrize(
    ("calls", "headline", "lines"),
    [
        (
            [_all_reduce(torch.ones(2, 3)), _all_reduce(torch.ones(2, 3, dtype=torch.int32))],
            "the processes called rt.all_reduce with tensors of different dtypes",
            [
                "  rank 0 is in rt.all_reduce(op='sum') of a float32 tensor of shape (2, 3) "
                "(collective #0)",
                "  rank 1 is in rt.all_reduce(op='sum') of an int32 tensor of shape (2, 3) "
                "(collective #0)",
            ],
        ),
        (
            [Call.of("rt.save"), Call.of(SHUFFLE)],
            "rt.save must be called on every process (the main process alone writes the "
            "file), remove the rank guard (`if rank == 0:`)",
            [
                "  rank 0 is in rt.save (collective #0)",
                f"  rank 1 is in {SHUFFLE} (collective #0)",
            ],
        ),
        (
            [_all_reduce(torch.ones(1)), Call.of("rt.barrier"), Call.of("rt.barrier")],
            "a call every process must make is inside a rank guard such as `if rank == 0:`",
            [
                "  rank 0 is in rt.all_reduce(op='sum') of a float32 tensor of shape (1,) "
                "(collective #0)",
                "  ranks 1, 2 are in rt.barrier (collective #0)",
            ],
        ),
        (
            [Call.of("rt.broadcast_object", src=0), Call.of("rt.broadcast_object", src=1)],
            "rt.broadcast_object with different source ranks (src=)",
            [
                "  rank 0 is in rt.broadcast_object(src=0) (collective #0)",
                "  rank 1 is in rt.broadcast_object(src=1) (collective #0)",
            ],
        ),
        (
            [
                Call.of("rt.all_gather", torch.ones(4, 3)),
                Call.of("rt.all_gather", torch.ones(5, 2)),
            ],
            "rt.all_gather with tensors of different shapes",
            [
                "  rank 0 is in rt.all_gather of a float32 tensor of shape (N, 3) (collective #0)",
                "  rank 1 is in rt.all_gather of a float32 tensor of shape (N, 2) (collective #0)",
            ],
        ),
    ],
    ids=["dtype", "guarded-save", "barrier", "src", "shape"],
)
def test_the_message_names_the_cause_then_each_ranks_call(
    calls: list[Call], headline: str, lines: list[str]
) -> None:
    first, *rest = mismatch_message(calls).splitlines()
    assert headline in first and "--no-collective-check" in first
    assert rest == lines


def test_all_gather_lengths_may_differ_between_ranks() -> None:
    """An evaluation loader's last batch splits unevenly: gathering it is not a mismatch."""
    calls = [Call.of("rt.all_gather", torch.ones(4, 3)), Call.of("rt.all_gather", torch.ones(3, 3))]
    assert calls[0].fingerprint() == calls[1].fingerprint()
    scalars = [Call.of("rt.all_gather", torch.ones(())), Call.of("rt.all_gather", torch.ones(1))]
    assert scalars[0].fingerprint() != scalars[1].fingerprint()
