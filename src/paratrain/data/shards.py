"""Tar shards in WebDataset's format, with their lengths, read as an iterable data set that
reads only what it is asked for (:class:`~paratrain.data.iterable_split.RangeSource`).

A folder of shards holds ``shards.json`` (each split's shard files and how many samples
each holds) and the ``.tar`` files, one sample per key, each of its tensors a ``.npy``
member (``0.npy``, ``1.npy``, ...): what ``paratrain data shard`` writes from a recipe's
data, and :func:`write_shards` from any data set of tensors. The ``webdataset`` package
writes and reads the tars (``pip install paratrain[stream]``).

An epoch's order: the shards in their order (or, with ``shuffle``, a permutation drawn from
``seed + epoch``), each shard's samples in theirs (or a permutation drawn from the same
seed, the epoch and the shard). It depends on nothing but the seed and the epoch: every
process and worker computes it alike, and a resumed epoch starts where it stopped, without
opening the shards before it. A shard is read from its start (tar is sequential), and only
the samples asked for are decoded.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from paratrain.utils.atomic import atomic_write_text
from paratrain.utils.errors import UserError

#: the index of a folder of shards
INDEX = "shards.json"
_INSTALL = "tar shards need the webdataset package: install paratrain[stream]"


def _webdataset() -> Any:
    try:
        import webdataset
    except ImportError:
        raise UserError(_INSTALL) from None
    return webdataset


def is_shard_folder(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds shards (their index)."""
    return (Path(folder) / INDEX).is_file()


@dataclass(frozen=True)
class Shard:
    """One tar file and how many samples it holds."""

    path: str
    samples: int


class ShardStream(IterableDataset[Any]):
    """The samples of tar shards of known lengths, as tuples of tensors (see the module)."""

    def __init__(self, shards: Sequence[Shard], *, shuffle: bool = False, seed: int = 0) -> None:
        self.shards = list(shards)
        self.shuffle = shuffle
        self.seed = seed

    @classmethod
    def from_folder(
        cls, folder: str | os.PathLike[str], split: str = "train", **options: Any
    ) -> ShardStream:
        """The shards of ``split`` in a folder :func:`write_shards` wrote."""
        index = Path(folder) / INDEX
        if not index.is_file():
            raise UserError(f"{folder} holds no {INDEX}: write shards with `paratrain data shard`")
        splits = json.loads(index.read_text())["splits"]
        if split not in splits:
            raise UserError(f"{index} has no split {split!r}; it has {', '.join(splits)}")
        shards = [Shard(str(Path(folder) / s["file"]), int(s["samples"])) for s in splits[split]]
        return cls(shards, **options)

    def __len__(self) -> int:
        return sum(shard.samples for shard in self.shards)

    def __iter__(self) -> Iterator[Any]:
        """Epoch 0's samples, all of them (``rt.setup_loader`` asks for its parts)."""
        return self.read([(0, len(self))], 0)

    def open_shard(self, path: str) -> IO[bytes]:
        """The file of one shard, opened for reading (a place to count or redirect opens)."""
        return open(path, "rb")

    def _generator(self, epoch: int, shard: int = -1) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed + epoch) * 1_000_003 + shard + 1)

    def shard_order(self, epoch: int) -> list[int]:
        """The shards in ``epoch``'s order."""
        count = len(self.shards)
        if not self.shuffle:
            return list(range(count))
        return torch.randperm(count, generator=self._generator(epoch)).tolist()

    def sample_order(self, epoch: int, shard: int) -> list[int]:
        """The samples of ``shard`` in ``epoch``'s order (their places in its file)."""
        count = self.shards[shard].samples
        if not self.shuffle:
            return list(range(count))
        return torch.randperm(count, generator=self._generator(epoch, shard)).tolist()

    def read(self, spans: Sequence[tuple[int, int]], epoch: int) -> Iterator[Any]:
        """The samples at the places ``spans`` of ``epoch``'s order, in that order; a shard
        none of them lies in is not opened."""
        first = 0
        wanted = iter(sorted(i for start, end in spans for i in range(start, end)))
        place = next(wanted, None)
        for shard in self.shard_order(epoch):
            last = first + self.shards[shard].samples
            places = []
            while place is not None and place < last:
                places.append(place - first)
                place = next(wanted, None)
            if places:
                yield from self._samples(shard, places, epoch)
            first = last
            if place is None:
                return

    def _samples(self, shard: int, places: list[int], epoch: int) -> Iterator[Any]:
        """The samples at ``places`` (sorted) of ``shard``'s order in ``epoch``."""
        order = self.sample_order(epoch, shard)
        offsets = {order[place] for place in places}
        found: dict[int, Any] = {}
        path = self.shards[shard].path
        select = _Select(offsets)
        with self.open_shard(path) as file:
            for sample in _tar_samples(file, path, select):
                found[select.offset_of[sample["__key__"]]] = _decode(sample)
                if len(found) == len(offsets):
                    break
        if len(found) < len(offsets):
            raise UserError(
                f"{path} holds fewer samples than its index says "
                f"({self.shards[shard].samples}); write the shards again"
            )
        for place in places:
            yield found.pop(order[place])


class _Select:
    """Which tar members to read: those of the samples at ``offsets`` in the file (the
    others' bytes are passed over, not read into memory nor decoded)."""

    def __init__(self, offsets: set[int]) -> None:
        self.offsets = offsets
        self.offset_of: dict[str, int] = {}
        self._key: str | None = None
        self._offset = -1

    def __call__(self, name: str) -> bool:
        key, _ = _webdataset().tariterators.base_plus_ext(name)
        if key != self._key:  # a sample's members come together: a new key, the next sample
            self._key, self._offset = key, self._offset + 1
            if self._offset in self.offsets:
                self.offset_of[key] = self._offset
        return self._offset in self.offsets


def _tar_samples(file: IO[bytes], url: str, select: _Select) -> Iterator[dict[str, Any]]:
    """The selected samples of one tar stream, their members grouped by key (webdataset's
    reader)."""
    tariterators = _webdataset().tariterators
    members = tariterators.tar_file_iterator(file, select_files=select)
    return tariterators.group_by_keys({**member, "__url__": url} for member in members)


def _decode(sample: dict[str, Any]) -> Any:
    """A sample's ``0.npy``, ``1.npy``, ... members as a tuple of tensors (one: a tensor)."""
    fields = sorted((k for k in sample if k.endswith(".npy")), key=lambda k: int(k.split(".")[0]))
    tensors = [torch.from_numpy(_npy(k, sample[k])) for k in fields]
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


#: parsed ``.npy`` headers by their bytes: (dtype, shape, Fortran order); every sample of a
#: member has the same header, and numpy parses it with ``ast.literal_eval``, which costs
#: as much as reading the member from the tar
_HEADERS: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], bool]] = {}
_HEADERS_KEPT = 256


def _npy(name: str, data: bytes) -> np.ndarray[Any, Any]:
    """A ``.npy`` member's array, its header parsed once (webdataset's decoder otherwise:
    another version of the format, or an array of Python objects)."""
    # the magic string (6 bytes), the version (2), the header's length (2 bytes in 1.0)
    if data[6:8] != b"\x01\x00":
        return _webdataset().autodecode.basichandlers(name, data)
    start = 10 + int.from_bytes(data[8:10], "little")
    header = data[:start]
    known = _HEADERS.get(header)
    if known is None:
        stream = io.BytesIO(header)
        np.lib.format.read_magic(stream)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        if dtype.hasobject:
            return _webdataset().autodecode.basichandlers(name, data)
        if len(_HEADERS) >= _HEADERS_KEPT:
            _HEADERS.clear()
        known = _HEADERS[header] = (dtype, shape, fortran)
    dtype, shape, fortran = known
    flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=start)
    return flat.reshape(shape, order="F" if fortran else "C").copy()


def write_shards(
    folder: str | os.PathLike[str],
    splits: dict[str, Dataset[Any]],
    samples_per_shard: int,
) -> Path:
    """Write each data set of ``splits`` (samples: tensors or tuples of them) as tar shards
    of ``samples_per_shard`` samples into ``folder``, with the index; returns the index."""
    if samples_per_shard < 1:
        raise UserError(f"samples per shard must be at least 1, got {samples_per_shard}")
    wds = _webdataset()
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    index: dict[str, list[dict[str, Any]]] = {}
    for split, dataset in splits.items():
        index[split] = []
        count = len(dataset)  # type: ignore[arg-type]
        for number, start in enumerate(range(0, count, samples_per_shard)):
            name = f"{split}-{number:05d}.tar"
            end = min(start + samples_per_shard, count)
            # whole-second times: no PAX header per member, half the headers to read
            with wds.TarWriter(str(root / name), mtime=int(time.time())) as writer:
                for i in range(start, end):
                    writer.write(_encoded(i, dataset[i]))
            index[split].append({"file": name, "samples": end - start})
    payload = json.dumps({"format": 1, "splits": index}, indent=1)
    atomic_write_text(root / INDEX, payload)
    return root / INDEX


def _encoded(key: int, sample: Any) -> dict[str, Any]:
    tensors = sample if isinstance(sample, (tuple, list)) else (sample,)
    record: dict[str, Any] = {"__key__": f"{key:09d}"}
    for number, tensor in enumerate(tensors):
        record[f"{number}.npy"] = torch.as_tensor(tensor).numpy()
    return record
