"""The runtime's notes about evaluation under several processes: a loader set up for
training iterated under ``torch.no_grad()``, and ``rt.print`` of counts that were never
all-reduced. Each note is said once, on the main process."""

from __future__ import annotations

from paratrain.data.loaders import DeviceLoader
from paratrain.distributed.collective import Collective


class EvaluationNotes:
    """Whether an evaluation loop's sums are still partial, and the notes said so far."""

    def __init__(self, collective: Collective, shards: int) -> None:
        self.collective = collective
        self.shards = shards
        #: an evaluation loop ran under several processes and nothing was all-reduced since
        self.unreduced = False
        self._told: set[str] = set()

    def loop_started(self, loader: DeviceLoader) -> None:
        """A loader iterated under ``torch.no_grad()`` while processes share the data: each
        process sees only its part, so its sums are partial until all-reduced."""
        self.unreduced = True
        if not loader.evaluation:
            self.tell(
                "training-loader",
                "a loader set up for training is iterated under torch.no_grad() (an "
                f"evaluation?) by {self.shards} processes: each sees only its "
                "part of the data, and a process with no sample of a last batch smaller than "
                "the number of processes counts a stand-in (one of the others' samples again). "
                "For evaluation, set it up with rt.setup_loader(loader, "
                "evaluation=True) (every sample exactly once) and sum the counts with "
                "rt.all_reduce before printing them (docs/porting.md)",
            )

    def reduced(self) -> None:
        self.unreduced = False

    def before_print(self) -> None:
        if self.unreduced:
            self.tell(
                "unreduced-print",
                f"rt.print after an evaluation loop with no rt.all_reduce since: what it "
                f"prints was counted by the main process alone, on about 1/{self.shards} of "
                "the data. Sum per-process counts first, e.g. correct = "
                "rt.all_reduce(torch.tensor(correct)).item() (docs/porting.md)",
            )

    def tell(self, key: str, message: str) -> None:
        """Say ``message`` once per ``key``, on the main process."""
        if key not in self._told:
            self._told.add(key)
            self.collective.note(f"paratrain: note: {message}")
