"""Mutation testing of the modules whose bugs change a user's model or lose their data.

    OMP_NUM_THREADS=1 python benchmarks/mutation.py [MODULE ...] [--max-children N]
    python benchmarks/mutation.py --list

mutmut (``pip install mutmut``, 3.x) changes one thing at a time in a module (a ``<`` into
``<=``, a constant, a dropped argument...) and runs the tests that call the changed function;
a mutant no test notices ("survived") is a bug the suite would let through. Each module of
:data:`MODULES` is mutated in its own scratch copy of the repository (``.mutation/NAME/``,
ignored by git), against only the tests listed for it, so that one module takes minutes on
a 2-core machine. Not part of the per-commit CI: run it after changing a module below, then
kill each new survivor with a test or explain in ``tests/mutation/SURVIVORS.md`` why it is
equivalent.

Prints one line per module (mutants, killed, survived, no tests, timeouts, score = killed /
(killed + survived)) and writes each survivor's diff to ``.mutation/NAME/survivors.txt``.
mutmut sees which tests call a function in the test process only: code run only by
launched processes or the CLI subprocess counts as "no tests", so the lists below name the
in-process tests of each module. The general mutmut settings are ``[tool.mutmut]`` in
pyproject.toml.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRATCH = REPO / ".mutation"
COPIED = ("src", "tests", "pyproject.toml", "README.md", "docs", "ARCHITECTURE.md")

#: pytest options that leave out the tests mutants cannot reach: launched processes and the
#: CLI subprocess import the package itself, not mutmut's mutated copy
IN_PROCESS = ["-k", "not cli and not real_processes and not gloo_processes"]

#: name -> (the source files mutated, the test files run against them); smallest and
#: highest-value first
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "atomic": (["src/paratrain/utils/atomic.py"], ["tests/unit/utils/test_atomic.py"]),
    "precision": (
        ["src/paratrain/devices/precision.py"],
        ["tests/unit/devices/test_precision.py", "tests/unit/runtime/test_runtime.py"],
    ),
    "optim": (
        ["src/paratrain/runtime/optim.py"],
        [
            "tests/unit/devices/test_precision.py",
            "tests/unit/runtime/test_optim_wrapper.py",
            "tests/integration/test_accumulate.py",
            "tests/unit/runtime/test_runtime.py",
        ],
    ),
    "batching": (
        ["src/paratrain/runtime/batching.py"],
        ["tests/integration/test_batch_size_per.py"],
    ),
    "keys": (
        ["src/paratrain/checkpoints/files/keys.py"],
        [
            "tests/unit/checkpoints/test_checkpoint_keys.py",
            "tests/unit/checkpoints/test_load_weights.py",
            "tests/unit/checkpoints/test_checkpoint_security.py",
            *IN_PROCESS,
        ],
    ),
    "loaders": (
        ["src/paratrain/data/loaders.py", "src/paratrain/data/batched_loader.py"],
        [
            "tests/unit/data/test_loaders.py",
            "tests/unit/data/test_device_loader.py",
            "tests/integration/test_evaluation_counts.py",
            "tests/integration/test_data_paths.py",
            *IN_PROCESS,
        ],
    ),
    "data_paths": (
        ["src/paratrain/data/paths.py"],
        [
            "tests/unit/data/test_data_path_rules.py",
            "tests/integration/test_data_paths.py",
            *IN_PROCESS,
        ],
    ),
    "uneven": (["src/paratrain/runtime/uneven.py"], ["tests/unit/runtime/test_uneven_join.py"]),
    "weights": (
        ["src/paratrain/checkpoints/weights.py"],
        [
            "tests/unit/checkpoints/test_weights.py",
            "tests/unit/checkpoints/test_load_weights.py",
            "tests/unit/checkpoints/test_file_formats.py",
            *IN_PROCESS,
        ],
    ),
    # the checkpoint directory and its manifest; the rest of training_state (snapshot, rng,
    # background saving) is exercised by launched runs mutmut cannot see: mutants planted
    # there by hand are in tests/mutation/SURVIVORS.md
    "training_state": (
        ["src/paratrain/checkpoints/state/store.py", "src/paratrain/checkpoints/state/manifest.py"],
        [
            "tests/unit/checkpoints/test_checkpoint_store.py",
            "tests/unit/checkpoints/test_checkpoint_integrity.py",
            *IN_PROCESS,
        ],
    ),
    "gradient_sync": (
        ["src/paratrain/strategies/ddp.py", "src/paratrain/strategies/distributed.py"],
        ["tests/integration/test_ddp.py", "tests/integration/test_accumulate.py"],
    ),
}

_RESULT = re.compile(r"^\s*(\S+): (.+)$")


def _prepare(name: str, sources: list[str], tests: list[str]) -> Path:
    """A fresh copy of the repository whose mutmut settings name this module and its tests."""
    work = SCRATCH / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for item in COPIED:
        source = REPO / item
        if source.is_dir():
            shutil.copytree(source, work / item, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, work / item)
    # test files that exist, and pytest options among them (``-k``, ``not cli``)
    existing = [t for t in tests if not t.startswith("tests/") or (REPO / t).exists()]
    scope = (
        f"only_mutate = {sources!r}\npytest_add_cli_args_test_selection = {existing!r}\n"
    ).replace("'", '"')
    pyproject = (work / "pyproject.toml").read_text(encoding="utf-8")
    if "[tool.mutmut]\n" not in pyproject:
        pyproject += "\n[tool.mutmut]\n"
    pyproject = pyproject.replace("[tool.mutmut]\n", "[tool.mutmut]\n" + scope, 1)
    (work / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    return work


def _results(work: Path) -> dict[str, str]:
    done = subprocess.run(
        ["mutmut", "results", "--all", "true"], cwd=work, capture_output=True, text=True
    )
    found = (_RESULT.match(line) for line in done.stdout.splitlines())
    return {m.group(1): m.group(2).strip() for m in found if m}


def run_module(name: str, max_children: int) -> dict[str, int]:
    sources, tests = MODULES[name]
    if not any((REPO / t).exists() for t in tests if t.startswith("tests/")):  # or all the suite
        return {"mutants": 0, "killed": 0, "survived": 0, "no tests": 0, "timeout": 0, "seconds": 0}
    work = _prepare(name, sources, tests)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy's code
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    subprocess.run(
        ["mutmut", "run", "--max-children", str(max_children)],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        check=False,
    )
    results = _results(work)
    survivors = sorted(k for k, status in results.items() if status == "survived")
    with open(work / "survivors.txt", "w", encoding="utf-8") as out:
        for mutant in survivors:
            shown = subprocess.run(
                ["mutmut", "show", mutant], cwd=work, capture_output=True, text=True
            )
            out.write(f"## {mutant}\n{shown.stdout}\n")
    counts = {
        status: sum(1 for s in results.values() if s == status)
        for status in ("killed", "survived", "no tests", "timeout")
    }
    counts["mutants"] = len(results)
    counts["seconds"] = round(time.monotonic() - started)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once")
    parser.add_argument("--list", action="store_true", help="the modules and their tests")
    args = parser.parse_args()
    if args.list:
        for name, (sources, tests) in MODULES.items():
            print(f"{name}: {' '.join(sources)}  <-  {' '.join(tests)}")
        return
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        sys.exit(f"unknown module {unknown[0]!r}; known: {', '.join(MODULES)}")
    print("module          mutants  killed  survived  no-tests  timeout  score  seconds")
    for name in args.modules or list(MODULES):
        c = run_module(name, args.max_children)
        tested = c["killed"] + c["survived"]
        score = f"{100 * c['killed'] / tested:.0f}%" if tested else "-"
        print(
            f"{name:<15} {c['mutants']:>7}  {c['killed']:>6}  {c['survived']:>8}  "
            f"{c['no tests']:>8}  {c['timeout']:>7}  {score:>5}  {c['seconds']:>7}",
            flush=True,
        )


if __name__ == "__main__":
    main()
