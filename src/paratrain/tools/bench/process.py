"""One combination's worker: a fresh interpreter that stays for all of its timed windows."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.launching.parent_death import PARENT_VARIABLE
from paratrain.tools.bench import control
from paratrain.tools.bench.worker import WORKER_CODE, RunSpec, collect
from paratrain.utils import environment

_LAUNCHER_VARIABLES = frozenset(
    (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class WorkerProcess:
    """Starts ``spec`` in a fresh interpreter (which starts its own process group if the
    layout needs several processes), then times windows on request (bench/control.py)."""

    def __init__(self, spec: RunSpec, processes: int, timeout: float) -> None:
        self.processes = processes
        self.timeout = timeout
        self._tmp = Path(tempfile.mkdtemp(prefix="paratrain-bench-"))
        spec_path = self._tmp / "spec.json"
        spec_path.write_text(json.dumps(spec.to_dict()), encoding="utf-8")
        self.out_dir = self._tmp / "out"
        self.out_dir.mkdir()
        # the worker's processes ring it when they are ready and after each window
        self._bell = control.Doorbell(self.out_dir / control.RUNNER_BELL)
        self.started_at, self._begin = now(), time.perf_counter()
        self.windows = 0
        self.failed: str | None = None
        self._stop_asked = False
        command = [sys.executable, "-c", WORKER_CODE, str(spec_path), str(self.out_dir)]
        # A bench started inside a launched group must not make its workers think they are
        # ranks of that group.
        # it must not outlive this bench
        env = environment.child_environment(
            {PARENT_VARIABLE: str(os.getpid())}, without=_LAUNCHER_VARIABLES
        )
        # A session of its own: on a timeout the whole group (launched ranks too) is ended.
        # stderr to a file: a pipe nobody reads while the worker waits could fill and block it
        self._stderr = self._tmp / "stderr.txt"
        with self._stderr.open("w", encoding="utf-8") as stderr:
            self._proc = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
                start_new_session=True,
            )

    def _wait_for(self, done: Callable[[], bool], what: str) -> bool:
        """Wait (asleep until the worker rings) for ``done()``; False (and ``failed`` set)
        if the worker ended or took longer than the timeout."""
        deadline = time.perf_counter() + self.timeout
        while not done():
            if self._proc.poll() is not None:
                self.failed = self.failed or f"worker exited with {self._proc.returncode}"
                return False
            left = deadline - time.perf_counter()
            if left < 0:
                self.failed = f"timed out after {self.timeout:.0f}s ({what})"
                self._kill()
                return False
            self._bell.wait(min(left, control.WAKE_SECONDS))
        return True

    def wait_ready(self) -> bool:
        """Started, built and warmed up (False: it failed; ``finish`` says why)."""
        return self._wait_for(lambda: control.all_ready(self.out_dir, self.processes), "start")

    def window(self) -> float | None:
        """Time one window: its seconds, or None if the worker failed."""
        if self.failed is not None:
            return None
        index = self.windows
        control.ask_window(self.out_dir, index, self.processes)
        seen: list[float] = []

        def timed() -> bool:
            value = control.window_seconds(self.out_dir, self.processes, index)
            if value is not None:
                seen.append(value)
            return bool(seen)

        if not self._wait_for(timed, f"window {index + 1}"):
            return None
        self.windows += 1
        return seen[0]

    def ask_stop(self) -> None:
        """Tell the worker to write its results and end (``finish`` waits for it): every
        worker at once, so they end side by side."""
        if not self._stop_asked:
            control.ask_stop(self.out_dir, self.processes)
            self._stop_asked = True

    def finish(self) -> dict[str, Any]:
        """Stop the worker and merge what its processes wrote (worker.collect)."""
        self.ask_stop()
        try:
            self._proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.failed = self.failed or f"timed out after {self.timeout:.0f}s (stopping)"
            self._kill()
            self._proc.wait()
        except BaseException:  # Ctrl-C reaches only our group: end the worker's too
            self._kill()
            self._proc.wait()
            raise
        result = collect(self.out_dir, self.processes)
        stderr = self._stderr.read_text(encoding="utf-8", errors="replace")
        if self.failed is not None and self.failed.startswith("timed out"):
            result.update(status="error", reason=self.failed)
        elif result["status"] == "error" and not result.get("reason"):
            tail = [line for line in (stderr or "").strip().splitlines() if line.strip()]
            result["reason"] = tail[-1][:300] if tail else self.failed
        result["run"] = {
            "started_at": self.started_at,
            "finished_at": now(),
            "wall_seconds": time.perf_counter() - self._begin,
            "returncode": self._proc.returncode,
            "windows": self.windows,
        }
        self._bell.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        return result

    def kill(self) -> None:
        """End it now (an interrupted bench)."""
        self._kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        self._bell.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _kill(self) -> None:
        """End the worker and every process it started (they share its session)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
