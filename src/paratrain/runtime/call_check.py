"""Before each collective every rank must make (``rt.all_reduce``, ``rt.all_gather``,
``rt.broadcast_object``, ``rt.barrier``, ``rt.save``, ``rt.load``, ``rt.save_weights``, a
shuffled loader's epoch), the ranks check that they are in the same call, with the same
tensor.

Without it, ranks in different calls pair them anyway: an ``rt.all_reduce`` of a float32
tensor on one rank and of an int32 tensor on another returns garbage on both and the run
goes on; an ``rt.save`` kept under ``if rank == 0:`` hands the main process's random states
to the other rank's loader, which fails far from the cause.

The check rides on the small all-reduce that already runs before those calls (the step's
agreement with a step of -1, :mod:`paratrain.runtime.agreement`): each rank folds a
fingerprint of its call (which call, its reduce op or source rank, the tensor's dtype, number
of elements and shape) into it, reduced with ``max`` and ``-max`` so that one rank that
differs shows. Only then, a second small collective gathers every rank's call, and every rank
stops with the same message: the likely cause, then one line per rank naming its call.
``collective_check=False`` (``--no-collective-check``) turns it off with the rest of the
collective check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import dataclass

import torch

from paratrain.distributed.collective_order import LEDGER
from paratrain.runtime.agreement import BEFORE_COLLECTIVE
from paratrain.runtime.parts import RuntimeParts
from paratrain.utils.errors import LaunchError

#: a shuffled loader's seed at the start of its epoch (rank 0's draw, broadcast)
SHUFFLE = "the shuffle of a loader (at the start of its epoch)"
#: the calls the check knows, by number (the numbers travel between ranks)
CALLS = (
    "rt.all_reduce",
    "rt.all_gather",
    "rt.broadcast_object",
    "rt.barrier",
    "rt.save",
    "rt.load",
    "rt.save_weights",
    SHUFFLE,
)
#: calls that write or read a file from the main process: every rank must still call them
_FILE_CALLS = frozenset({"rt.save", "rt.load", "rt.save_weights"})
_OPS = ("sum", "mean", "max", "min")
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES, start=1)}
_OTHER_DTYPE = len(_DTYPES) + 1
#: dimensions of a tensor's shape sent whole (a larger shape is told by its first ones)
MAX_DIMS = 8
#: the first dimension of a call whose ranks may pass different lengths
ANY_LENGTH = -1
_ANY_LENGTH = frozenset({"rt.all_gather"})
_FINGERPRINT_BITS = 52  # a float64 holds every integer below 2**53 exactly


@dataclass(frozen=True)
class Call:
    """One rank's collective call as the ranks compare it."""

    #: its number in :data:`CALLS`
    kind: int
    #: the reduce op's number in ``_OPS`` plus one, or a broadcast's source rank plus one
    op: int = 0
    #: the tensor's dtype code (0: no tensor)
    dtype: int = 0
    ndim: int = 0
    numel: int = 0
    shape: tuple[int, ...] = ()
    #: the collective's number on this rank (the order check's ``collective #N``)
    number: int = 0

    @classmethod
    def of(
        cls, name: str, tensor: torch.Tensor | None = None, op: str | None = None, src: int = -1
    ) -> Call:
        code = _OPS.index(op) + 1 if op in _OPS else src + 1
        if tensor is None:
            return cls(CALLS.index(name), code)
        shape = tuple(int(size) for size in tensor.shape)
        dtype = _DTYPE_CODES.get(tensor.dtype, _OTHER_DTYPE)
        numel = tensor.numel()
        if name in _ANY_LENGTH and shape:  # the ranks' lengths may differ: not compared
            shape, numel = (ANY_LENGTH, *shape[1:]), ANY_LENGTH
        return cls(CALLS.index(name), code, dtype, len(shape), numel, shape[:MAX_DIMS])

    def vector(self) -> list[int]:
        """The call as a fixed number of integers (what the second collective gathers)."""
        dims = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        return [self.kind, self.op, self.dtype, self.ndim, self.numel, self.number, *dims]

    @classmethod
    def from_vector(cls, values: list[int]) -> Call:
        kind, op, dtype, ndim, numel, number, *dims = values
        return cls(kind, op, dtype, ndim, numel, tuple(dims[: min(ndim, MAX_DIMS)]), number)

    def fingerprint(self) -> int:
        """A number below 2**52 that differs between calls the ranks cannot pair (the call,
        its op or source, the tensor's dtype and shape; not the rank's own count)."""
        vector = self.vector()
        del vector[5]  # the number
        packed = struct.pack(f"<{len(vector)}q", *vector)
        digest = hashlib.blake2b(packed, digest_size=8).digest()
        return int.from_bytes(digest, "little") >> (64 - _FINGERPRINT_BITS)

    @property
    def name(self) -> str:
        return CALLS[self.kind] if 0 <= self.kind < len(CALLS) else "another collective"

    def describe(self) -> str:
        """``rt.all_reduce(op='sum') of a float32 tensor of shape (2, 3)`` and the like."""
        name = self.name
        if name == "rt.all_reduce":
            name += f"(op={_OPS[self.op - 1]!r})" if 0 < self.op <= len(_OPS) else "(op=?)"
        elif name == "rt.broadcast_object":
            name += f"(src={self.op - 1})"
        if not self.dtype:
            return name
        dtype = str(_DTYPES[self.dtype - 1]).removeprefix("torch.")
        if self.dtype == _OTHER_DTYPE:
            dtype = "another dtype's"
        return f"{name} of {_article(dtype)} {dtype} tensor of shape {self._shape()}"

    def _shape(self) -> str:
        sizes = ["N" if size == ANY_LENGTH else str(size) for size in self.shape]
        if self.ndim > MAX_DIMS:
            return f"({', '.join(sizes)}, ...) ({self.ndim} dimensions)"
        return f"({', '.join(sizes)})" if self.ndim != 1 else f"({sizes[0]},)"


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def check_call(rt: RuntimeParts, call: Call, here: str) -> None:
    """The check before a collective every rank must make: the last step's agreement read
    first (a non-finite loss raises), then, where the collective check is on, the small
    all-reduce that shows a rank still training or a rank in another call."""
    state = rt.state
    collective = rt.strategy.collective
    state.agreement.settle(collective)  # the last step's checks first (a NaN raises)
    if not rt.config.collective_check or collective.world_size == 1 or state.local_only:
        return
    mine = dataclasses.replace(call, number=LEDGER.count)
    fingerprint = mine.fingerprint()
    verdict = state.agreement.exchange(collective, BEFORE_COLLECTIVE, here, call=fingerprint)
    if verdict.same_call:
        return
    # Every rank saw the same reduced numbers: all of them are here, and gather the calls.
    vectors = collective.all_gather(torch.tensor(mine.vector(), dtype=torch.int64))
    calls = [Call.from_vector([int(v) for v in vector.tolist()]) for vector in vectors]
    raise LaunchError(mismatch_message(calls))


def mismatch_message(calls: list[Call]) -> str:
    """The likely cause, then one line per rank (ranks in the same call share a line)."""
    lines: dict[str, list[int]] = {}
    for rank, call in enumerate(calls):
        lines.setdefault(f"{call.describe()} (collective #{call.number})", []).append(rank)
    ranks = [
        f"  rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))} "
        f"{'are' if len(who) > 1 else 'is'} in {what}"
        for what, who in lines.items()
    ]
    return (
        f"{likely_cause(calls)}. Every process was stopped (collective_check=False, "
        "--no-collective-check, turns this check off):\n" + "\n".join(ranks)
    )


def likely_cause(calls: list[Call]) -> str:
    """What the calls' difference most likely means, and what to do."""
    names = {call.name for call in calls}
    if len(names) > 1:
        files = sorted(names & _FILE_CALLS)
        if files:
            return (
                f"the processes are in different collectives: {' and '.join(files)} must be "
                "called on every process (the main process alone writes the file), remove "
                "the rank guard (`if rank == 0:`) around it"
            )
        return (
            "the processes are in different collectives: a call every process must make is "
            "inside a rank guard such as `if rank == 0:`, or the processes make their "
            "collective calls in a different order"
        )
    name = calls[0].name
    if len({call.op for call in calls}) > 1:
        what = "source ranks (src=)" if name == "rt.broadcast_object" else "reduce ops"
        return f"the processes called {name} with different {what}: pass the same everywhere"
    what = "dtypes" if len({call.dtype for call in calls}) > 1 else "shapes"
    return (
        f"the processes called {name} with tensors of different {what}: a tensor made "
        f"differently on some process (under a rank guard such as `if rank == 0:`); every "
        f"process must pass the same {what[:-1]}"
    )
