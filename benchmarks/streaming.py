"""Data that does not fit in memory: samples per second through ``rt.setup_loader`` from tar
shards and from memory, and the time a resumed loader takes to hand out its first batch at
10% and at 90% of an epoch of 100,000 samples.

    python benchmarks/streaming.py [--samples 100000] [--per-shard 1000] [--repeats 3]

The samples: 16 float32 features and an int64 label each. The sources, one process, the
loader's batch of 256: a map-style ``TensorDataset`` (in memory; batches cut out of its
tensors, and through the DataLoader's ``__getitem__`` and collate), a plain ``IterableDataset``
over the same tensors (in memory, a stream), and the same samples written as tar shards
(``paratrain.data.shards``) read with 0 and with 2 DataLoader workers, and the same shards
read by a plain webdataset pipeline (``wds.WebDataset(urls).decode().to_tuple(...)``) in a
torch DataLoader, alone and through ``rt.setup_loader`` (paratrain's split by shards, its
per-step bookkeeping): the difference is what paratrain adds to a user's pipeline. Resuming: a fresh
loader given the position of batch 10% and 90% into the epoch (``load_state_dict``), timed
to its first batch. Shards seek (the shards before the position are not opened), so their
time must not grow with the position; a plain stream reads up to it.

Prints the median and range of the repeats, with the machine and the versions. Tar is read
sample by sample (a member's header, then its bytes): small samples cost their count, not
their bytes, so shards of tiny samples are slow; a resumed shard is read from its start up
to the position, so the time to resume is bounded by one shard's read.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import paratrain
from paratrain.data.shards import ShardStream, write_shards

BATCH = 256


class InMemoryStream(IterableDataset):  # type: ignore[type-arg]
    """The tensors' rows as a stream with no length (what a generator gives)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(len(self.x)):
            yield self.x[i], self.y[i]


def _spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s (range {min(times):.3f}-{max(times):.3f})"


def _epoch_rate(make: Callable[[], Any], samples: int, repeats: int) -> str:
    rates = []
    for _ in range(repeats):
        loader = make()
        start = time.perf_counter()
        count = sum(int(batch[1].shape[0]) for batch in loader)
        rates.append(count / (time.perf_counter() - start))
        assert count == samples, count
    return (
        f"{statistics.median(rates):>10,.0f} samples/s (range {min(rates):,.0f}-{max(rates):,.0f})"
    )


def _resume_time(make: Callable[[], Any], batch: int, repeats: int) -> str:
    times = []
    for _ in range(repeats):
        loader = make()
        loader.load_state_dict({"epoch": 0, "batch": batch})
        start = time.perf_counter()
        next(iter(loader))
        times.append(time.perf_counter() - start)
    return _spread(times)


def _pipeline_rows(rt: paratrain.Runtime, folder: str, samples: int, epochs: int) -> None:
    """The shards read by a plain webdataset pipeline, alone and through rt.setup_loader."""
    urls = sorted(str(path) for path in Path(folder).glob("*.tar"))

    def pipeline(workers: int, through_rt: bool) -> Callable[[], Any]:
        def make() -> Any:
            data = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("0.npy", "1.npy")
            made = DataLoader(data, batch_size=BATCH, num_workers=workers)
            return rt.setup_loader(made) if through_rt else made

        return make

    for workers in (0, 2):
        for through_rt in (False, True):
            rate = _epoch_rate(pipeline(workers, through_rt), samples, epochs)
            how = "rt.setup_loader" if through_rt else "plain DataLoader"
            print(f"  webdataset pipeline, {workers} workers, {how:<16} {rate}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000, help="samples (100,000)")
    parser.add_argument("--per-shard", type=int, default=1_000, help="samples a shard (1,000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (3)")
    parser.add_argument(
        "--shard-epochs", type=int, default=1, help="epochs read from shards, each way (1)"
    )
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, paratrain {paratrain.__version__}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=generator)
    y = torch.randint(0, 10, (args.samples,), generator=generator)
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        write_shards(folder, {"train": TensorDataset(x, y)}, args.per_shard)
        shards = len(list(Path(folder).glob("*.tar")))
        print(
            f"{args.samples:,} samples written as {shards} shards in "
            f"{time.perf_counter() - start:.1f} s; batches of {BATCH}, one process"
        )

        def memory(path: str) -> Callable[[], Any]:
            def make() -> Any:
                made = DataLoader(TensorDataset(x, y), batch_size=BATCH)
                return rt.setup_loader(made, data_path=path)

            return make

        def stream() -> Any:
            return rt.setup_loader(DataLoader(InMemoryStream(x, y), batch_size=BATCH))

        def sharded(workers: int) -> Callable[[], Any]:
            def make() -> Any:
                data = ShardStream.from_folder(folder)
                made = DataLoader(data, batch_size=BATCH, num_workers=workers)
                return rt.setup_loader(made)

            return make

        print("one epoch:")
        for path in ("batched", "loader"):
            rate = _epoch_rate(memory(path), args.samples, args.repeats)
            print(f"  memory (TensorDataset, {path:<7}) {rate}")
        rate = _epoch_rate(stream, args.samples, args.repeats)
        print(f"  memory (IterableDataset)          {rate}")
        for workers in (0, 2):
            rate = _epoch_rate(sharded(workers), args.samples, args.shard_epochs)
            print(f"  shards, {workers} workers                  {rate}")
        _pipeline_rows(rt, folder, args.samples, args.shard_epochs)
        batches = -(-args.samples // BATCH)
        print("resuming mid-epoch, time to the first batch:")
        for share in (0.1, 0.9):
            at = int(batches * share)
            print(
                f"  at {share:.0%} (batch {at:>4}): shards "
                f"{_resume_time(sharded(0), at, args.repeats)}; stream "
                f"{_resume_time(stream, at, args.repeats)}"
            )


if __name__ == "__main__":
    main()
