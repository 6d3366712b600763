"""Weights files are recognised by their contents, whatever their name and first byte.

A safetensors file starts with its header length (8 bytes, little-endian), so its first byte
is that length's lowest byte: 0x80 (pickle's PROTO) when the length is 128 mod 256, and
``PK\\x03\\x04`` (a zip archive's magic) for one length. The structure decides, not the byte.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import paratrain
from paratrain.checkpoints.files.readers import is_safetensors, sniff
from paratrain.cli.main import main
from paratrain.utils.errors import UserError

METADATA = {"format": "pt", "note": "first byte test"}


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 2).state_dict()


def header_length(path: Path) -> int:
    with open(path, "rb") as handle:
        return int(struct.unpack("<Q", handle.read(8))[0])


def write_safetensors(path: Path, length: int) -> None:
    """A real safetensors file (written by safetensors) whose header is ``length`` bytes:
    its metadata is padded until the header has that size."""
    pad = 0
    for _ in range(4):
        save_file(weights(), str(path), metadata={**METADATA, "pad": "x" * pad})
        got = header_length(path)
        if got == length:
            return
        pad += length - got
    raise AssertionError(f"could not make a {length}-byte safetensors header")


def inspect_json(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, object]:
    assert main(["ckpt", "inspect", str(path), "--json"]) == 0
    report: dict[str, object] = json.loads(capsys.readouterr().out)
    return report


# (header length, the file's first bytes): 128 mod 256 begins like a pickle, and one length
# begins like a zip archive (a torch.save file).
MISLEADING = {
    "pickle PROTO": (128 + 256, b"\x80"),
    "zip magic": (0x04034B50, b"PK\x03\x04"),
}


@pytest.mark.parametrize("case", list(MISLEADING))
@pytest.mark.slow
def test_safetensors_whose_first_bytes_look_like_torch_is_read_as_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    length, start = MISLEADING[case]
    path = tmp_path / "weights.bin"  # the name gives nothing away
    write_safetensors(path, length)
    assert path.read_bytes()[: len(start)] == start  # what used to be taken for torch
    assert is_safetensors(path) and sniff(path) == "safetensors"

    model = nn.Linear(4, 2)
    report = paratrain.load_weights(model, path)
    assert report.ok and sorted(report.loaded) == ["bias", "weight"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights().items())

    summary = inspect_json(capsys, path)
    assert summary["format"] == "safetensors"
    metadata = summary["metadata"]
    assert isinstance(metadata, dict)
    assert {k: metadata[k] for k in METADATA} == METADATA
    assert main(["ckpt", "inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"{path} (safetensors)" in text and "note=first byte test" in text


def test_a_safetensors_header_cut_short_is_named_truncated_not_a_bad_pickle(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.pt"
    write_safetensors(path, 128 + 256)
    path.write_bytes(path.read_bytes()[:200])  # inside the header
    assert path.read_bytes()[0] == 0x80 and sniff(path) == "safetensors"
    with pytest.raises(UserError, match=r"truncated or corrupted: its header claims 384 bytes"):
        paratrain.load_weights(nn.Linear(4, 2), path)


@pytest.mark.parametrize("protocol", [2, 3])  # weights_only reads no later protocol
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_torch_files_are_still_torch(tmp_path: Path, protocol: int, zipped: bool) -> None:
    path = tmp_path / "model.safetensors"  # a misleading name
    buffer = io.BytesIO()
    torch.save(weights(), buffer, pickle_protocol=protocol, _use_new_zipfile_serialization=zipped)
    path.write_bytes(buffer.getvalue())
    assert not is_safetensors(path) and sniff(path) == "torch"
    assert paratrain.load_weights(nn.Linear(4, 2), path).ok


NOT_SAFETENSORS = {
    "array": struct.pack("<Q", 2) + b"[]",  # JSON, but not an object
    "not JSON": struct.pack("<Q", 9) + b"{not json",
    "past the end": struct.pack("<Q", 108) + b'{"a": 1}',  # claims more than the file has
    "huge length": struct.pack("<Q", 2**40) + b'{"a": 1}',
    "8 bytes": struct.pack("<Q", 0),
    "2 bytes": b"\x80\x02",
}


@pytest.mark.parametrize("case", list(NOT_SAFETENSORS))
def test_only_a_complete_json_object_header_is_safetensors(tmp_path: Path, case: str) -> None:
    path = tmp_path / "file.bin"
    path.write_bytes(NOT_SAFETENSORS[case])
    assert not is_safetensors(path)
    path.write_bytes(struct.pack("<Q", 8) + b'{"a": 1}')
    assert is_safetensors(path)
