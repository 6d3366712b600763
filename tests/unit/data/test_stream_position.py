"""Where training stands in the data, as ``rt.save`` keeps it (``loader.state_dict()``):
the epoch and the global batches of it handed out, for an iterable data set's loader and a
map-style one alike; a fresh loader given it hands out exactly the batches the epoch had
left. (Before, a loader other than torchdata's StatefulDataLoader kept no position.)"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import paratrain


class _Sized(IterableDataset):  # type: ignore[type-arg]
    """0..n-1 that reads only the places asked for, and says which it read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read_places: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self.read([(0, self.n)], 0)

    def read(self, spans: Sequence[tuple[int, int]], epoch: int) -> Iterator[torch.Tensor]:
        for start, end in spans:
            for place in range(start, end):
                self.read_places.append(place)
                yield torch.tensor(place + 100 * epoch)


class _Unsized(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(10).unbind())


def _batches(loader: Any, stop: int | None = None) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch[0].tolist())
        if len(out) == stop:
            break
    return out


def test_an_iterable_loaders_position_resumes_the_epoch_where_it_stopped() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    data = _Sized(10)
    loader = rt.setup_loader(DataLoader(data, batch_size=3))
    assert len(loader) == 4 and loader.state_dict() == {"epoch": 0, "batch": 0}
    assert _batches(loader) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert loader.state_dict() == {"epoch": 1, "batch": 0}
    assert _batches(loader, stop=2) == [[100, 101, 102], [103, 104, 105]]
    state = loader.state_dict()
    assert state == {"epoch": 1, "batch": 2}
    fresh_data = _Sized(10)
    fresh = rt.setup_loader(DataLoader(fresh_data, batch_size=3))
    fresh.load_state_dict(state)
    assert len(fresh) == 2
    assert _batches(fresh) == [[106, 107, 108], [109]]
    assert fresh_data.read_places == [6, 7, 8, 9]  # nothing before the position is read
    assert _batches(fresh) == [[200, 201, 202], [203, 204, 205], [206, 207, 208], [209]]


def test_a_stream_without_a_length_resumes_too_and_has_no_len() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    loader = rt.setup_loader(DataLoader(_Unsized(), batch_size=4))
    assert _batches(loader, stop=1) == [[0, 1, 2, 3]]
    fresh = rt.setup_loader(DataLoader(_Unsized(), batch_size=4))
    fresh.load_state_dict(loader.state_dict())
    assert _batches(fresh) == [[4, 5, 6, 7], [8, 9]]
    try:
        len(fresh)
    except TypeError as exc:
        assert "has no length" in str(exc)
    else:
        raise AssertionError("len() of a stream without a length")


def test_a_map_style_loaders_position_resumes_the_epoch_where_it_stopped() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)

    def loader() -> Any:
        data = TensorDataset(torch.arange(10))
        return rt.setup_loader(DataLoader(data, batch_size=3, shuffle=True), data_path="loader")

    whole = loader()
    epochs = [_batches(whole), _batches(whole)]
    stopped = loader()
    _batches(stopped)
    assert _batches(stopped, stop=1) == epochs[1][:1]
    resumed = loader()
    resumed.load_state_dict(stopped.state_dict())
    assert stopped.state_dict() == {"epoch": 1, "batch": 1}
    assert _batches(resumed) == epochs[1][1:]
