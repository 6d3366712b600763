"""``paratrain train`` under torchrun's elastic agent: several machines (``--nnodes``,
``--node-rank``, ``--rdzv-endpoint``) and automatic restarts (``--max-restarts N``).

The launcher side (:func:`start_agent`, one per machine) checks everything it can before any
process starts, on every machine: the configuration, the options of the machines, and that
the global batch covers every process of every machine. Machine 0 prepares ``--out``. The
configuration reaches the processes as JSON in ``PARATRAIN_TRAIN_CONFIG``.

The process side (:func:`worker_config`): the first attempt trains as configured. After a
restart (``TORCHELASTIC_RESTART_COUNT`` > 0) it continues from the run's newest complete
checkpoint, exactly as ``--resume`` would (bit-identical on the CPU with the same layout),
or starts the run again when no checkpoint was complete yet.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from paratrain.checkpoints.state import latest_checkpoint
from paratrain.launching.agent import Nodes, previous_failure, run_agent
from paratrain.launching.threads import choose_for, say_note, started_note
from paratrain.strategies import count_processes, resolved_name, strategy_class
from paratrain.training import rundir
from paratrain.training.config import TrainConfig
from paratrain.training.recipes import get_recipe
from paratrain.training.resume import resume_config
from paratrain.utils import environment
from paratrain.utils.errors import UserError

CONFIG_VARIABLE = "PARATRAIN_TRAIN_CONFIG"
#: the options a restarted process passes on when it continues from a checkpoint
_CARRIED = ("epochs", "max_steps", "save_every", "keep", "progress")


def start_agent(cfg: TrainConfig, nodes: Nodes) -> int:
    """Train ``cfg`` in this machine's processes under the agent; returns the exit code."""
    nodes.check()
    cfg = cfg.resolved(get_recipe)
    # under the agent "auto" is ddp; the strategy is asked, not built
    name = "ddp" if cfg.strategy == "auto" else cfg.strategy
    kind = strategy_class(resolved_name(name, cfg.devices))
    if nodes.nnodes > 1 and not kind.spans_machines:
        raise UserError(f"--nnodes {nodes.nnodes} needs --strategy ddp, not {cfg.strategy}")
    if nodes.nnodes > 1 and cfg.out is None:
        raise UserError(
            f"--nnodes {nodes.nnodes} needs --out DIR, the same on every machine (a shared "
            "filesystem, for checkpoints and restarts)"
        )
    processes = count_processes(name, cfg.devices)
    world = nodes.nnodes * processes
    assert cfg.batch_size is not None
    if cfg.batch_size < world:
        raise UserError(
            f"--batch-size {cfg.batch_size} is smaller than the number of processes "
            f"({nodes.nnodes} machine(s) x {processes} = {world}); every "
            "process needs at least one sample"
        )
    if cfg.resume_from is None and nodes.node_rank == 0:
        cfg.out = str(rundir.prepare(cfg.out, cfg.recipe, cfg.overwrite))
    cfg.strategy = kind.name
    env = {CONFIG_VARIABLE: json.dumps(cfg.to_dict())}
    # set before torchrun: it warns and sets OMP_NUM_THREADS=1 where nobody chose
    threads = choose_for(processes, cfg.threads, not cfg.deterministic)
    env.update(threads.child_environment())
    say_note(started_note(threads, processes))
    entry = ["paratrain.cli.entry", "train"]
    run_agent(entry, processes, env, nodes, "paratrain train", cfg.hang_timeout)
    return 0


def worker_config() -> tuple[TrainConfig, str | None]:
    """This process's configuration, and the run directory when it is already prepared
    (None: the main process prepares ``cfg.out``)."""
    env = environment.current()
    raw = env.get(CONFIG_VARIABLE)
    if not raw:
        raise UserError(f"{CONFIG_VARIABLE} is not set: start this through `paratrain train`")
    cfg = TrainConfig.of(**json.loads(raw))
    assert cfg.out is not None
    restart = env.attempt
    if restart == 0:
        return cfg, (cfg.out if cfg.resume_from is not None else None)
    if latest_checkpoint(Path(cfg.out)) is None:
        # Failed before its first checkpoint: start again, replacing what it wrote.
        return dataclasses.replace(cfg, resume_from=None, overwrite=True), None
    given = {name: getattr(cfg, name) for name in _CARRIED}
    resumed = resume_config(cfg.out, given)
    if env.is_rank_zero:
        print(
            f"paratrain: note: {_what_failed(restart)}; restart {restart}: continuing from "
            f"{resumed.resume_from}",
            flush=True,
        )
    return resumed, resumed.out


def _what_failed(restart: int) -> str:
    """Which rank made the previous attempt fail, from the launcher's report folder."""
    env = environment.current()
    if env.report_dir is None:
        return "a process failed"
    return previous_failure(env.report_dir, restart - 1, env.world_size)
