"""Ranks that disagree about a collective (the call, its tensor's dtype or shape), and ranks
that run out of memory where the step cannot be redone, stop with a few lines naming the
cause: exit code 1, no traceback, never a garbage result.

Devices: `ddp` on `cpu,cpu`, two real processes: under `paratrain run` (torchrun's agent),
`paratrain train` (spawn) and plain torchrun. Each script is a few lines; the collective
check's background thread is left at its default (50 s): the check before the collective
is what stops these runs, at once.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import subprocess_env
from helpers.cli import run_paratrain
from paratrain_test_faults import OOM_VARIABLE

pytestmark = pytest.mark.slow  # real processes

DDP_CPU = ("--strategy", "ddp", "--devices", "cpu,cpu")
HEAD = """
import torch
from torch import nn
import paratrain

rt = paratrain.Runtime(oom="auto")
"""


def _run(tmp_path: Path, body: str, *args: str) -> tuple[int, str]:
    """`paratrain run` of HEAD + ``body`` on ddp cpu,cpu: the exit code and stderr."""
    script = tmp_path / "train.py"
    script.write_text(HEAD + textwrap.dedent(body), encoding="utf-8")
    done = run_paratrain("run", str(script), *DDP_CPU, *args, cwd=tmp_path, timeout=240)
    return done.returncode, done.stderr + done.stdout


def _lines(output: str) -> list[str]:
    """What paratrain printed, one entry per line, but its notes (a busy machine's threads,
    a micro-batch halved)."""
    return [
        line
        for line in output.splitlines()
        if line.strip() and not line.startswith("paratrain: note:")
    ]


def _stopped_with(output: str, headline: str, *ranks: str) -> None:
    """The error's first line names the cause, then one line per rank; nothing else."""
    lines = _lines(output)
    assert lines[0].startswith("paratrain: error: ") and headline in lines[0], output
    assert lines[1:] == [f"  {rank}" for rank in ranks], output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("tensor", "headline", "other"),
    [
        (
            "torch.ones(2, 3, dtype=torch.int32)",
            "rt.all_reduce with tensors of different dtypes",
            "an int32 tensor of shape (2, 3)",
        ),
        (
            "torch.ones(3, 2)",
            "rt.all_reduce with tensors of different shapes",
            "a float32 tensor of shape (3, 2)",
        ),
    ],
    ids=["dtype", "shape"],
)
def test_an_all_reduce_of_different_tensors_stops_instead_of_returning_garbage(
    tmp_path: Path, tensor: str, headline: str, other: str
) -> None:
    """Rank 0 all-reduces a float32 (2, 3) tensor, rank 1 another dtype or shape: gloo
    paired them (1.0000001 on one rank, 1065353216 on the other; exit 0)."""
    code, output = _run(
        tmp_path,
        f"""
        tensor = torch.ones(2, 3) if rt.rank == 0 else {tensor}
        print("result", rt.all_reduce(tensor).flatten()[0].item())
        """,
    )
    assert code == 1, output
    assert "result" not in output
    _stopped_with(
        output,
        headline,
        "rank 0 is in rt.all_reduce(op='sum') of a float32 tensor of shape (2, 3) (collective #1)",
        f"rank 1 is in rt.all_reduce(op='sum') of {other} (collective #1)",
    )


def test_an_all_reduce_against_a_barrier_names_both_calls(tmp_path: Path) -> None:
    """rt.all_reduce on rank 0 only, rt.barrier on rank 1 only."""
    code, output = _run(
        tmp_path,
        """
        if rt.rank == 0:
            print(rt.all_reduce(torch.ones(1)))
        else:
            rt.barrier()
        """,
    )
    assert code == 1, output
    _stopped_with(
        output,
        "the processes are in different collectives: a call every process must make is "
        "inside a rank guard such as `if rank == 0:`",
        "rank 0 is in rt.all_reduce(op='sum') of a float32 tensor of shape (1,) (collective #1)",
        "rank 1 is in rt.barrier (collective #1)",
    )


#: the PyTorch DDP tutorial's multigpu.py, ported but for its rank guard around the save
HALF_PORT = """
from torch.utils.data import DataLoader, TensorDataset

class Trainer:
    def __init__(self, model, train_data, optimizer, save_every):
        self.gpu_id = rt.rank
        self.model, self.optimizer = rt.setup(model, optimizer)
        self.train_data = rt.setup_loader(train_data)
        self.save_every = save_every

    def _run_epoch(self, epoch):
        for source, targets in self.train_data:
            self.optimizer.zero_grad()
            rt.backward(nn.functional.mse_loss(self.model(source), targets))
            self.optimizer.step()

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                rt.save("checkpoint.pt", {"model": self.model})

data = TensorDataset(torch.rand(16, 20), torch.rand(16, 1))
model = nn.Linear(20, 1)
loader = DataLoader(data, batch_size=8, shuffle=True)
Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=1e-3), 1).train(3)
"""


def test_the_half_ported_tutorial_stops_at_its_guarded_save(tmp_path: Path) -> None:
    """rt.save under `if self.gpu_id == 0:`: rank 1 went on to the next epoch, where its
    loader's shuffle got rank 0's random states (`int() argument must be ... not 'dict'`,
    and a traceback)."""
    code, output = _run(tmp_path, HALF_PORT)
    assert code == 1, output
    _stopped_with(
        output,
        "the processes are in different collectives: rt.save must be called on every "
        "process (the main process alone writes the file), remove the rank guard "
        "(`if rank == 0:`) around it",
        "rank 0 is in rt.save (collective #5)",
        "rank 1 is in the shuffle of a loader (at the start of its epoch) (collective #5)",
    )
    assert not (tmp_path / "checkpoint.pt").exists()


def test_out_of_memory_under_rt_backward_says_forward_backward_in_one_line(
    tmp_path: Path,
) -> None:
    """Runtime(oom="auto") with model(x) and rt.backward: rank 1 runs out in the model's
    forward, which --oom auto cannot redo (a 59-line report before)."""
    code, output = _run(
        tmp_path,
        """
        class Model(nn.Linear):
            def forward(self, x):
                if rt.rank == 1:
                    raise torch.OutOfMemoryError("CUDA out of memory (as a GPU would)")
                return super().forward(x)

        model = Model(4, 1)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        rt.backward(model(torch.randn(4, 4)).sum())
        """,
    )
    assert code == 1, output
    assert _lines(output) == [
        "paratrain: error: rank 1 ran out of memory in the model's forward at step 1: "
        "--oom auto redoes a micro-batch only inside rt.forward_backward(model, loss_fn, x, "
        "y); use it instead of model(x) and rt.backward(loss)"
    ]


NOTHING_LEFT = "out of memory on rank(s) 1 at step 1 with one sample per process: nothing left"


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_out_of_memory_at_one_sample_per_process_is_one_line(tmp_path: Path, launcher: str) -> None:
    """`paratrain train --oom auto` (spawn), and the same under plain torchrun: rank 1
    runs out whatever the piece, halving down to one sample, where nothing is left to halve
    (a 29-line traceback before)."""
    env = subprocess_env(**{OOM_VARIABLE: "1:0"})
    torchrun = ("--standalone", "--nproc-per-node", "2") if launcher == "torchrun" else ()
    done = run_paratrain(
        *("train", "--recipe", "linear", *DDP_CPU, "--oom", "auto", "--batch-size", "4"),
        *("--max-steps", "2", "--no-progress", "--out", str(tmp_path / "run")),
        env=env,
        timeout=240,
        torchrun=torchrun,
    )
    assert done.returncode == 1, done.stderr
    # a note as the piece is halved (2 samples, then 1), then the stop: each one line
    errors = [line for line in _lines(done.stderr) if line.startswith("paratrain: error:")]
    assert len(errors) == 1 and NOTHING_LEFT in errors[0], done.stderr
    assert "OutOfMemoryStop" not in done.stderr and "paratrain/runtime" not in done.stderr
    if launcher == "spawn":
        assert "Traceback" not in done.stderr
