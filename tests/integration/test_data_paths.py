"""The data paths: batches cut out of tensors equal the DataLoader's, bit for bit.

Every comparison runs the per-sample DataLoader path ("loader") next to a tensor path
("batched", or the device-resident one on the CPU) with the same settings, and asks for
``torch.equal`` batches, the same loss weights and epoch ends carried, the same
``len()`` and the same epochs, through automatic epochs and ``set_epoch(epoch, start_batch)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CLI
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset, TensorDataset

import paratrain
from paratrain.cli.main import main
from paratrain.data.batched_loader import TensorBatchLoader
from paratrain.data.cifar import CIFAR_MEAN, CIFAR_STD, _to_dataset
from paratrain.data.images import NormalizedImages
from paratrain.data.loaders import PLAIN_BATCH, DeviceLoader, batch_info, shard_loader
from paratrain.data.paths import _device_unfit, setup_data_path
from paratrain.data.tensor_data import TensorRows, tensor_rows
from paratrain.runtime.step_state import StepState
from paratrain.utils.errors import UserError

pytestmark = pytest.mark.slow  # real processes, or several layers at work


CPU = torch.device("cpu")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
#: automatic epochs, a resume into epoch 5 at batch 2, then automatic again
PLAN: list[tuple[int, int] | None] = [None, None, (5, 2), None]


def _tensors(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3, 2, generator=generator)
    y = torch.randint(0, 10, (n,), generator=generator)
    w = torch.rand(n, generator=generator, dtype=torch.float64)
    return TensorDataset(x, y, w)


def _setup(
    dataset: Any,
    data_path: str,
    *,
    rank: int,
    world: int,
    evaluation: bool,
    shuffle: bool = True,
    drop_last: bool = False,
    device: torch.device = CPU,
) -> tuple[DeviceLoader, StepState]:
    sink = StepState()
    loader = setup_data_path(
        DataLoader(dataset, batch_size=6, shuffle=shuffle, drop_last=drop_last),
        device=device,
        rank=rank,
        world_size=world,
        seed=11,
        evaluation=evaluation,
        sink=None if evaluation else sink,  # as the runtime does
        data_path=data_path,
    )
    return loader, sink


def _record(loader: DeviceLoader, sink: StepState) -> list[Any]:
    """Everything a loop can observe: batches, what they carry, lengths and epochs."""
    seen: list[Any] = []
    for step in PLAN:
        if step is not None:
            loader.set_epoch(*step)
        seen.append(("len before", len(loader)))
        for batch in loader:
            info = batch_info(batch) or PLAIN_BATCH
            seen.append((batch, info.loss_weight, info.ends_epoch))
        seen.append(("after", len(loader), loader.epoch))
    return seen


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [23, 25])  # last batch 5 (split); 1 (dropped for training)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("evaluation", [True, False])
def test_batched_equals_loader(
    world: int, n: int, shuffle: bool, drop_last: bool, evaluation: bool
) -> None:
    dataset = _tensors(n)
    for rank in range(world):
        settings: dict[str, Any] = dict(rank=rank, world=world, evaluation=evaluation)
        settings.update(shuffle=shuffle, drop_last=drop_last)
        loader, loader_sink = _setup(dataset, "loader", **settings)
        batched, batched_sink = _setup(dataset, "batched", **settings)
        assert (loader.data_path, batched.data_path) == ("loader", "batched")
        expected = _record(loader, loader_sink)
        assert len(expected) > len(PLAN) * 2  # batches were seen
        _assert_same(_record(batched, batched_sink), expected)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("evaluation", [True, False])
def test_device_resident_cut_equals_loader_on_any_device(world: int, evaluation: bool) -> None:
    """The device path's loader takes any device: on the CPU it is checked like the others."""
    dataset = _tensors(25)
    for rank in range(world):
        loader, sink = _setup(dataset, "loader", rank=rank, world=world, evaluation=evaluation)
        expected = _record(loader, sink)
        resident, sink = _resident(dataset, rank, world, evaluation, CPU)
        assert resident.data_path == "device"
        _assert_same(_record(resident, sink), expected)


def _resident(
    dataset: Any, rank: int, world: int, evaluation: bool, device: torch.device
) -> tuple[TensorBatchLoader, StepState]:
    sink = StepState()
    rebuilt, sampler = shard_loader(
        DataLoader(dataset, batch_size=6, shuffle=True),
        rank=rank,
        world_size=world,
        seed=11,
        evaluation=evaluation,
        pin_memory=False,
    )
    rows = tensor_rows(dataset)
    assert isinstance(rows, TensorRows) and sampler is not None
    loader = TensorBatchLoader(
        rebuilt,
        device,
        sampler,
        rows,
        resident=True,
        loss_weight_sink=None if evaluation else sink,
    )
    return loader, sink


def _old_cifar_normalisation(data: np.ndarray) -> torch.Tensor:
    """What CIFAR-10's loader stored before images were kept as bytes."""
    x = torch.from_numpy(data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
    mean = torch.tensor(CIFAR_MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - mean) / std


def _cifar_bytes(n: int) -> NormalizedImages:
    data = np.random.default_rng(0).integers(0, 256, size=(n, 3072), dtype=np.uint8)
    data[0] = np.tile(np.arange(256, dtype=np.uint8), 12)  # every value in every channel
    return _to_dataset(data, np.arange(n, dtype=np.int64) % 10)


def test_cifar_bytes_normalise_to_the_old_floats_exactly() -> None:
    dataset = _cifar_bytes(300)
    raw = dataset.tensors[0].numpy().reshape(300, 3072)
    old = _old_cifar_normalisation(raw)
    images, labels = dataset.transform_batch(list(dataset.tensors))
    assert images.dtype == torch.float32 and torch.equal(images, old)
    assert all(torch.equal(dataset[i][0], old[i]) for i in range(300))
    assert torch.equal(labels, dataset.tensors[1])


@pytest.mark.parametrize("world", [1, 2])
def test_cifar_bytes_batched_equals_loader(world: int) -> None:
    dataset = _cifar_bytes(40)
    for rank in range(world):
        loader, sink = _setup(dataset, "loader", rank=rank, world=world, evaluation=False)
        expected = _record(loader, sink)
        batched, sink = _setup(dataset, "batched", rank=rank, world=world, evaluation=False)
        _assert_same(_record(batched, sink), expected)


def test_a_generator_the_user_passed_stays_in_step() -> None:
    states = []
    for data_path in ("loader", "batched"):
        generator = torch.Generator().manual_seed(3)
        loader = paratrain.Runtime(strategy="cpu", seed=0).setup_loader(
            DataLoader(_tensors(20), batch_size=6, shuffle=True, generator=generator),
            data_path=data_path,
        )
        rng = torch.get_rng_state()
        for _ in range(2):
            list(loader)
        assert torch.equal(torch.get_rng_state(), rng)  # the global generator is untouched
        states.append(generator.get_state())
    assert torch.equal(states[0], states[1])


# -- which path ------------------------------------------------------------------------------
class _OwnItems(TensorDataset):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[index] * 2 for t in self.tensors)


class _Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index**2)


def _collate(items: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    return [torch.stack(column) for column in zip(*items, strict=True)]


CANNOT_BATCH = {
    "collate": (lambda: DataLoader(_tensors(8), 4, collate_fn=_collate), "own collate_fn"),
    "workers": (lambda: DataLoader(_tensors(8), 4, num_workers=1), "num_workers=1"),
    "getitem": (lambda: DataLoader(_OwnItems(torch.ones(8)), 4), "_OwnItems overrides"),
    "dataset": (lambda: DataLoader(_Squares(), 4), "_Squares is neither"),
    "sampler": (lambda: DataLoader(_tensors(8), None), "own sampler or batch_sampler"),
}


def test_auto_cuts_tensor_batches_on_the_cpu() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    assert rt.setup_loader(DataLoader(_tensors(8), 4)).data_path == "batched"
    assert rt.setup_loader(DataLoader(_cifar_bytes(8), 4), evaluation=True).data_path == "batched"
    assert rt.setup_loader(DataLoader(_tensors(8), 4), data_path="loader").data_path == "loader"


@pytest.mark.parametrize("case", sorted(CANNOT_BATCH))
def test_auto_falls_back_and_batched_says_why(case: str) -> None:
    build, reason = CANNOT_BATCH[case]
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    assert rt.setup_loader(build()).data_path == "loader"
    for data_path in ("batched", "device"):
        with pytest.raises(UserError, match=reason) as info:
            rt.setup_loader(build(), data_path=data_path)
        assert "\n" not in str(info.value) and '"loader"' in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_path": "fast"}, "unknown data path 'fast'; valid data paths: auto, loader"),
        ({"data_path": "device"}, "needs a CUDA or MPS device, and this process trains on cpu"),
        ({"device_budget_gib": 0.0}, "positive GiB figure, got 0.0"),
    ],
)
def test_bad_data_path_arguments(kwargs: dict[str, Any], message: str) -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    with pytest.raises(UserError, match=message):
        rt.setup_loader(DataLoader(_tensors(8), 4), **kwargs)


def test_data_over_the_budget_is_not_copied_to_the_device() -> None:
    rows = tensor_rows(TensorDataset(torch.zeros(2**18, 1024)))  # 1 GiB
    assert isinstance(rows, TensorRows)
    cuda = torch.device("cuda", 0)  # the budget is given: nothing asks the device
    assert _device_unfit(rows, cuda, 2.0) is None
    reason = _device_unfit(rows, cuda, 0.5)
    assert reason == (
        "the data takes 1.00 GiB, more than the budget on cuda:0 (0.50 GiB); raise "
        '--device-budget-gib (device_budget_gib) or use "batched"'
    )


# -- the command line ------------------------------------------------------------------------
def _weights(cli: CLI, out: Path, *args: str) -> dict[str, torch.Tensor]:
    result = cli("train", "--recipe", "digits", "--no-progress", "--out", str(out), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_batched_and_loader_train_bit_identical_weights(
    paratrain_here: CLI, tmp_path: Path
) -> None:
    steps = ("--strategy", "cpu", "--max-steps", "30")
    loader = _weights(paratrain_here, tmp_path / "loader", *steps, "--data-path", "loader")
    batched = _weights(paratrain_here, tmp_path / "batched", *steps, "--data-path", "batched")
    _assert_bit_identical(loader, batched)
    # Stopped at step 12 on one path, resumed to 30 on the other: the same weights again.
    stop = ("--strategy", "cpu", "--max-steps", "12", "--data-path", "batched")
    _weights(paratrain_here, tmp_path / "resumed", *stop)
    resume = ("--resume", str(tmp_path / "resumed"), "--max-steps", "30", "--no-progress")
    resumed = paratrain_here("train", *resume, "--data-path", "loader")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_bit_identical(loader, load_file(str(tmp_path / "resumed" / "model.safetensors")))


def test_cli_ddp_batched_equals_loader(paratrain_here: CLI, tmp_path: Path) -> None:
    ddp = ("--strategy", "ddp", "--devices", "cpu,cpu", "--max-steps", "30")
    loader = _weights(paratrain_here, tmp_path / "loader", *ddp, "--data-path", "loader")
    batched = _weights(paratrain_here, tmp_path / "batched", *ddp, "--data-path", "batched")
    _assert_bit_identical(loader, batched)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--data-path", "fast"), "unknown data path 'fast'; valid data paths: auto, loader"),
        (("--data-path", "device"), "needs a CUDA or MPS device, and this process trains on cpu"),
        (("--device-budget-gib", "-1"), "the device budget must be a positive GiB figure"),
    ],
)
def test_cli_bad_data_path_exits_2_with_one_line(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["train", "--strategy", "cpu", "--out", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # refused before anything was written


# -- CUDA --------------------------------------------------------------------------------------
@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_batched_and_device_paths_equal_loader(world: int) -> None:
    cuda = torch.device("cuda", 0)
    for dataset in (_tensors(25), _cifar_bytes(40)):
        for rank in range(world):
            where: dict[str, Any] = dict(rank=rank, world=world, evaluation=False, device=cuda)
            loader, sink = _setup(dataset, "loader", **where)
            expected = _record(loader, sink)
            for data_path in ("batched", "device"):
                other, sink = _setup(dataset, data_path, **where)
                assert other.data_path == data_path
                _assert_same(_record(other, sink), expected)
    rt = paratrain.Runtime(strategy="cuda", seed=0)
    assert rt.setup_loader(DataLoader(_tensors(8), 4)).data_path == "device"
    batched = rt.setup_loader(DataLoader(_tensors(8), 4), data_path="batched")
    assert batched.data_path == "batched"
    with pytest.raises(UserError, match="more than the budget"):
        rt.setup_loader(DataLoader(_tensors(8), 4), data_path="device", device_budget_gib=1e-9)
