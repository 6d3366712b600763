"""`paratrain doctor` reads the project, not the file: local imports, folders, rank tests of
any spelling, and findings it is not sure of (shown with --all)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from paratrain.cli.main import main
from paratrain.tools.doctor import diagnose

#: torchvision's references, DINO, DeiT: print replaced by a rank-0 print in utils.py
RANK0_PRINT = """
import builtins
import torch.distributed as dist

def setup_for_distributed(is_master):
    builtin_print = builtins.print
    def print(*args, **kwargs):
        force = kwargs.pop("force", False)
        if is_master or force:
            builtin_print(*args, **kwargs)
    builtins.print = print

def init_distributed_mode(args):
    dist.init_process_group("nccl")
    setup_for_distributed(dist.get_rank() == 0)
"""
MAIN = """
import utils

def main(args):
    utils.init_distributed_mode(args)
    print("epoch", 1)
    print("loss is nan, stopping", force=True)

if __name__ == "__main__":
    main(None)
"""


def write(folder: Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")


def rules(path: Path) -> list[tuple[int, str]]:
    return [(f.line, f.rule) for f in diagnose(path).findings]


def test_print_replaced_in_an_imported_module_is_rank_aware(tmp_path: Path) -> None:
    ddp = "from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(net)\n"
    write(tmp_path, {"main.py": ddp + MAIN, "utils.py": RANK0_PRINT})
    assert rules(tmp_path / "main.py") == []


def test_without_the_replacement_every_rank_prints(tmp_path: Path) -> None:
    helper = "import torch.distributed as dist\ndef init_distributed_mode(args):\n"
    write(tmp_path, {"main.py": MAIN, "utils.py": helper + '    dist.init_process_group("nccl")\n'})
    # the imported helper starts the process group: main's prints run on every rank
    assert rules(tmp_path / "main.py") == [(6, "unguarded-output")]


def test_a_star_import_lends_its_names(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "utils.py": "import torch.distributed as dist\n",
            "train.py": """
            from utils import *
            dist.init_process_group("nccl")
            print("every rank says this")
            """,
        },
    )
    assert rules(tmp_path / "train.py") == [(4, "unguarded-output")]


def test_a_star_imported_save_helper_runs_on_every_rank(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "utils.py": """
            import torch
            def save_checkpoint(state):
                torch.save(state, "c.pt")
            """,
            "train.py": """
            import torch.distributed as dist
            from utils import *
            dist.init_process_group("nccl")
            save_checkpoint({"step": 1})
            """,
        },
    )
    assert rules(tmp_path / "train.py") == [(5, "unguarded-output")]


def test_relative_imports_of_a_package_are_read(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "pkg/__init__.py": "from .helpers import *\n",
            "pkg/helpers.py": "def train(loader, sampler, epoch):\n    sampler.set_epoch(epoch)\n",
            "run.py": """
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler
            from pkg import train
            dist.init_process_group("nccl")
            sampler = DistributedSampler(data)
            loader = DataLoader(data, sampler=sampler, pin_memory=True, num_workers=4)
            for epoch in range(3):
                train(loader, sampler, epoch)
            """,
        },
    )
    assert rules(tmp_path / "run.py") == []  # set_epoch is called, in pkg/helpers.py


@pytest.mark.parametrize(
    "guard",
    [
        'if int(os.environ.get("RANK", 0)) == 0:',
        'if os.environ["LOCAL_RANK"] == "0":',
        "if utils_is_main_process():",
    ],
)
def test_rank_tests_of_any_spelling(tmp_path: Path, guard: str) -> None:
    source = f"""
import os
import torch.distributed as dist
dist.init_process_group("nccl")
{guard}
    print("once")
"""
    write(tmp_path, {"train.py": source})
    assert rules(tmp_path / "train.py") == []


def test_a_process_launcher_parent_prints_once(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "hogwild.py": """
            import torch.multiprocessing as mp
            import torch.distributed as dist
            def train(rank):
                dist.init_process_group("gloo", rank=rank, world_size=4)
                print("training")  # every worker
            if __name__ == "__main__":
                print("starting 4 workers")
                processes = [mp.Process(target=train, args=(r,)) for r in range(4)]
            """,
        },
    )
    assert rules(tmp_path / "hogwild.py") == [(6, "unguarded-output")]


def test_an_evaluator_out_of_sight_makes_the_finding_unsure(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "main.py": """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler
            from coco_tools import evaluate
            dist.init_process_group("nccl")
            val_sampler = DistributedSampler(val_set, shuffle=False)
            val_loader = DataLoader(val_set, sampler=val_sampler, pin_memory=True, num_workers=4)
            evaluate(model, val_loader)
            """,
        },
    )
    diagnosis = diagnose(tmp_path / "main.py")
    assert diagnosis.findings == []
    assert [f.rule for f in diagnosis.unsure] == ["eval-distributed-sampler"]


def test_a_folder_is_one_project(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        tmp_path,
        {
            "main.py": MAIN,
            "utils.py": RANK0_PRINT,
            "engine.py": "def step(model):\n    return model\n",
            "train_ddp.py": """
            import torch.distributed as dist
            dist.init_process_group("nccl")
            print("hello")
            """,
            ".venv/lib/site.py": "print(",  # not the project's: never read
        },
    )
    assert main(["doctor", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'train_ddp.py'}:4: [unguarded-output]" in out
    assert f"{tmp_path / 'main.py'}: no findings" in out  # an entry script, listed
    assert "engine.py" not in out  # a module with nothing to say is left out
    assert main(["doctor", "--json", str(tmp_path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {Path(s["path"]).name: s["entry"] for s in report["scripts"]} == {
        "engine.py": False,
        "main.py": True,
        "train_ddp.py": True,
        "utils.py": False,
    }


def test_all_shows_what_doctor_is_not_sure_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    test_an_evaluator_out_of_sight_makes_the_finding_unsure(tmp_path)
    assert main(["doctor", str(tmp_path / "main.py")]) == 0
    assert "1 more unsure: --all" in capsys.readouterr().out
    assert main(["doctor", "--all", str(tmp_path / "main.py")]) == 1
    assert "[eval-distributed-sampler, unsure]" in capsys.readouterr().out
    assert main(["doctor", "--all", "--json", str(tmp_path / "main.py")]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["scripts"][0]["findings"]
    assert finding["sure"] is False


def test_a_path_that_is_neither_file_nor_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and err.count("\n") == 1


def test_a_file_of_a_folder_python_cannot_read_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, {"old.py": 'print "python 2"\n', "train.py": "x = 1\nprint(x)\n"})
    assert main(["doctor", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"skipped {tmp_path / 'old.py'}:1: syntax error")
    assert f"{tmp_path / 'train.py'}: no findings" in captured.out
    assert main(["doctor", str(tmp_path / "old.py")]) == 2  # a script named: one line, exit 2


def test_a_save_in_an_imported_trainer_runs_on_every_rank(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "trainer.py": """
            import io
            import torch

            class Trainer:
                def __init__(self, model):
                    self.model = model

                def save(self, path):
                    torch.save(self.model.state_dict(), path)

                def copy(self):
                    buffer = io.BytesIO()
                    torch.save(self.model.state_dict(), buffer)  # memory, not a file
            """,
            "utils.py": """
            import torch
            import torch.distributed as dist

            def save_on_master(*args):
                if dist.get_rank() == 0:
                    torch.save(*args)
            """,
            "main.py": """
            import torch.distributed as dist
            import utils
            from trainer import Trainer

            def main():
                dist.init_process_group("nccl")
                trainer = Trainer(build())
                trainer.copy()
                utils.save_on_master(trainer.model.state_dict(), "best.pt")
                trainer.save("last.pt")
                trainer.model.save_pretrained("out")
                trainer.model.save_pretrained("out", is_main_process=dist.get_rank() == 0)

            if __name__ == "__main__":
                main()
            """,
        },
    )
    diagnosis = diagnose(tmp_path / "main.py")
    assert [(f.line, f.rule) for f in diagnosis.findings] == [
        (11, "unguarded-output"),
        (12, "unguarded-output"),
    ]
    assert "trainer.py:10" in diagnosis.findings[0].message
