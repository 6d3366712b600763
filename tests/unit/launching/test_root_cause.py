"""Which rank torchrun's agent names as the cause when several failed in one look.

Devices: none (torchrun's failure records and a report folder, in this process).
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from paratrain.launching.agent import previous_failure, root_first
from paratrain.utils.reports import ReportFolder


def _seen(rank: int, exitcode: int, tmp_path: Path, at: int = 1000) -> ProcessFailure:
    """A failure as torchrun records it: no error file, seen at ``at`` (whole seconds)."""
    failure = ProcessFailure(rank, 4000 + rank, exitcode, str(tmp_path / "no-error-file"))
    failure.timestamp = at
    return failure


def test_the_rank_that_reported_first_is_the_cause_though_torchrun_saw_both_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1 raised; rank 0 then failed in a collective (its peer was gone). torchrun saw
    both in the same second and would name rank 0, the lower rank."""
    reports = ReportFolder(tmp_path)
    reports.failed(0, 1, "crash", "ValueError: boom")
    reports.failed(0, 0, "crash", "RuntimeError: Connection reset by peer")
    seen = ChildFailedError("fails.py", {0: _seen(0, 1, tmp_path), 1: _seen(1, 1, tmp_path)})
    assert seen.get_first_failure()[0] == 0  # torchrun's own pick

    named = root_first(seen, reports)
    assert isinstance(named, ChildFailedError)
    assert named.get_first_failure()[0] == 1
    assert set(named.failures) == {0, 1}
    assert "rank      : 1 " in named.format_msg().split("Root Cause", 1)[1]


def test_a_rank_killed_by_a_signal_is_the_cause_before_one_that_reported(
    tmp_path: Path,
) -> None:
    """Rank 1 was killed (no report); rank 0 reported its failed collective first, and was
    seen a second earlier."""
    reports = ReportFolder(tmp_path)
    reports.failed(0, 0, "crash", "RuntimeError: Connection closed by peer")
    seen = {0: _seen(0, 1, tmp_path, at=999), 1: _seen(1, -9, tmp_path, at=1000)}
    named = root_first(ChildFailedError("train", seen), reports)
    assert isinstance(named, ChildFailedError)
    rank, failure = named.get_first_failure()
    assert rank == 1 and failure.signal_name() == "SIGKILL"


def test_one_failure_is_its_own_cause(tmp_path: Path) -> None:
    seen = ChildFailedError("train", {1: _seen(1, 1, tmp_path)})
    named = root_first(seen, ReportFolder(tmp_path))
    assert isinstance(named, ChildFailedError) and named.get_first_failure()[0] == 1


def test_the_restart_note_names_the_killed_rank_not_the_one_torn_down_after_it(
    tmp_path: Path,
) -> None:
    """Rank 1 was killed; the agent then stopped rank 0 with SIGTERM, which rank 0 took for
    a stop (no report either). Both are silent: the agent's first look tells them apart."""
    reports = ReportFolder(tmp_path)
    reports.started(0, 0, 4000)
    reports.started(0, 1, 4001)
    reports.exited(0, {1: -9})
    reports.exited(0, {0: -15, 1: -9})  # a later look does not replace the first
    assert previous_failure(tmp_path, 0, 2).startswith("rank 1 died")


def test_the_restart_note_names_the_first_rank_that_raised_in_the_agents_first_look(
    tmp_path: Path,
) -> None:
    reports = ReportFolder(tmp_path)
    for rank in (0, 1, 2):
        reports.started(0, rank, 4000 + rank)
    reports.failed(0, 0, "crash", "Traceback\nRuntimeError: Connection closed by peer")
    reports.failed(0, 2, "crash", "Traceback\nValueError: bad batch")
    reports.exited(0, {2: 1})
    assert previous_failure(tmp_path, 0, 3) == "rank 2 failed (ValueError: bad batch)"


def test_without_the_agents_record_a_silent_rank_is_named(tmp_path: Path) -> None:
    """The processes of another machine failed first: this one's record is empty."""
    reports = ReportFolder(tmp_path)
    reports.started(0, 0, 4000)
    reports.started(0, 1, 4001)
    reports.failed(0, 0, "crash", "Traceback\nRuntimeError: Connection closed by peer")
    assert previous_failure(tmp_path, 0, 4).startswith("rank 1 died")


def test_a_rank_the_agent_ended_with_sigterm_is_not_the_cause(tmp_path: Path) -> None:
    """Rank 1 raised; the agent then sent rank 0 SIGTERM, which ended it before it said
    anything, and recorded both in the same look (seen in a test suite under load)."""
    reports = ReportFolder(tmp_path)
    reports.failed(0, 1, "crash", "ValueError: boom on rank one")
    seen = {0: _seen(0, -15, tmp_path), 1: _seen(1, 1, tmp_path)}
    named = root_first(ChildFailedError("fails.py", seen), reports)
    assert isinstance(named, ChildFailedError)
    assert named.get_first_failure()[0] == 1
    assert set(named.failures) == {0, 1}


def test_ranks_that_all_died_of_sigterm_are_still_named(tmp_path: Path) -> None:
    seen = {0: _seen(0, -15, tmp_path), 1: _seen(1, -15, tmp_path, at=999)}
    named = root_first(ChildFailedError("train", seen), ReportFolder(tmp_path))
    assert isinstance(named, ChildFailedError) and named.get_first_failure()[0] == 1


def test_the_restart_note_names_the_rank_that_raised_not_the_one_the_agent_ended(
    tmp_path: Path,
) -> None:
    reports = ReportFolder(tmp_path)
    reports.started(0, 0, 4000)
    reports.started(0, 1, 4001)
    reports.failed(0, 1, "crash", "Traceback\nValueError: boom on rank one")
    reports.exited(0, {0: -15, 1: 1})  # the agent's first look, its teardown included
    assert previous_failure(tmp_path, 0, 2) == "rank 1 failed (ValueError: boom on rank one)"
