"""Read one weights file without running code from it.

safetensors files hold only tensors. Anything pickled (``torch.save``) goes through
``torch.load(..., weights_only=True)``, whose unpickler refuses every global outside a short
allow-list, so a payload's ``__reduce__`` never runs. Every failure (missing file, pickled
code, truncation, random bytes) becomes a :class:`UserError` naming the file and the fault.
"""

from __future__ import annotations

import json
import pickle
import pickletools
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from paratrain.utils.errors import UserError

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
PICKLE_PROTO = 0x80  # every pickle of protocol 2+ starts with PROTO
#: the safetensors library refuses headers above this size
SAFETENSORS_MAX_HEADER = 100_000_000
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING"}
_SCAN_LIMIT = 64 * 2**20  # pickles of weights are small; the tensor bytes live elsewhere


def sniff(path: Path) -> str:
    """``safetensors``, ``torch`` or ``unknown``, from the contents, not the name.

    A safetensors file is recognised by its structure first: its first 8 bytes are a length
    and that many bytes of JSON object follow. Its first byte is that length's lowest byte,
    so it can be anything, 0x80 (pickle's PROTO) and ``P`` (zip's magic) included.
    """
    if is_safetensors(path):
        return "safetensors"
    head = _head(path, 9)
    if head.startswith(ZIP_MAGIC):
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":  # a safetensors header cut short
        return "safetensors"
    if head and head[0] == PICKLE_PROTO:
        return "torch"
    if path.suffix == ".safetensors":
        return "safetensors"
    return "unknown"


def is_safetensors(path: Path) -> bool:
    """Whether ``path`` starts with a complete safetensors header: an 8-byte little-endian
    length N, then N bytes (all inside the file) holding a JSON object. Reads only those."""
    head = _head(path, 8)
    if len(head) < 8:
        return False
    length = struct.unpack("<Q", head)[0]
    if length < 2 or length > SAFETENSORS_MAX_HEADER or 8 + length > path.stat().st_size:
        return False
    with open(path, "rb") as handle:
        handle.seek(8)
        header = handle.read(length)
    if not header.startswith(b"{"):
        return False
    try:
        return isinstance(json.loads(header), dict)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or absurdly nested
        return False


def _head(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except FileNotFoundError:
        raise UserError(f"no such file: {path}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the header's string metadata of a safetensors file."""
    _check_safetensors_size(path)
    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            for key in handle.keys():  # noqa: SIM118  (a safe_open handle is not a dict)
                tensors[key] = handle.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(
            f"{path} is truncated or corrupted safetensors: {_first_line(exc)}"
        ) from exc
    return tensors, metadata


def _check_safetensors_size(path: Path) -> None:
    """Name truncation plainly: the header says where the last tensor ends."""
    size = path.stat().st_size
    head = _head(path, 8)
    if len(head) < 8:
        raise UserError(f"{path} is truncated or corrupted: {size} bytes, not a safetensors file")
    header_len = struct.unpack("<Q", head)[0]
    if 8 + header_len > size:
        raise UserError(
            f"{path} is truncated or corrupted: its header claims {header_len:,} bytes "
            f"but the file has {size:,}"
        )
    with open(path, "rb") as handle:
        handle.seek(8)
        try:
            header = json.loads(handle.read(header_len))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise UserError(f"{path} is corrupted: its safetensors header is not valid") from None
    if 8 + header_len + end > size:
        raise UserError(
            f"{path} is truncated: its tensors need {8 + header_len + end:,} bytes "
            f"but the file has {size:,}"
        )


def read_torch(path: Path) -> Any:
    """``torch.load`` restricted to tensors and plain containers, on the CPU."""
    if _head(path, 4).startswith(ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as archive:
                archive.namelist()
        except (zipfile.BadZipFile, OSError) as exc:
            raise UserError(
                f"{path} is truncated or corrupted: not a complete torch.save archive ({exc})"
            ) from exc
    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols it may not support; the error below is clearer
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            # A handle, not the path: torch.load reads a path ending in .safetensors as
            # safetensors, whatever it holds.
            with open(path, "rb") as handle:
                return torch.load(handle, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        code = pickled_globals(path)
        if code:
            raise UserError(
                f"file {path} contains pickled code (GLOBAL {', '.join(code[:3])}); paratrain "
                "loads only tensors and plain containers, so none of it was run; save "
                "model.state_dict() (better: safetensors), not objects, if you trust the source"
            ) from exc
        raise UserError(f"{path} is truncated or corrupted: {_torch_reason(exc)}") from exc
    except Exception as exc:  # any other failure of a parser fed bad bytes
        raise UserError(f"{path} is truncated or corrupted: {_torch_reason(exc)}") from exc


def pickled_globals(path: Path) -> list[str]:
    """The globals a pickle in ``path`` would import that ``weights_only`` does not allow.

    Only scans opcodes (``pickletools.genops`` never executes anything).
    """
    try:
        data = _pickle_bytes(path)
    except (OSError, zipfile.BadZipFile, KeyError):
        return []
    found: list[str] = []
    position = 0
    while position < len(data):  # legacy torch files are several pickles back to back
        names, position = _scan_one(data, position)
        found += names
        if position < 0:
            break
    allowed = _allowed_globals()
    return [name for name in dict.fromkeys(found) if name not in allowed]


def _pickle_bytes(path: Path) -> bytes:
    if _head(path, 4).startswith(ZIP_MAGIC):
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            return archive.read(names[0]) if names else b""
    with open(path, "rb") as handle:
        return handle.read(_SCAN_LIMIT)


def _scan_one(data: bytes, start: int) -> tuple[list[str], int]:
    """Globals of the pickle starting at ``start``, and where the next one starts (-1: none)."""
    names: list[str] = []
    strings: list[str] = []  # recent string pushes, for STACK_GLOBAL's two operands
    memo: dict[int, str] = {}
    end = -1
    try:
        for op, arg, pos in pickletools.genops(data[start:]):
            if op.name in _STRING_OPS and isinstance(arg, str):
                strings.append(arg)
            elif op.name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif op.name in ("BINGET", "LONG_BINGET", "GET") and isinstance(arg, int):
                if arg in memo:
                    strings.append(memo[arg])
            elif op.name in ("GLOBAL", "INST") and isinstance(arg, str):
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif op.name == "STOP":
                end = start + (pos or 0) + 1
    except (ValueError, EOFError, KeyError, IndexError):
        pass  # raw tensor bytes after the last pickle, or garbage
    return names, end


def _allowed_globals() -> set[str]:
    allowed = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2"}
    try:
        from torch import _weights_only_unpickler

        allowed |= set(_weights_only_unpickler._get_allowed_globals())
    except (ImportError, AttributeError):
        pass  # older or newer torch: the short list above still names the usual suspects
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        allowed.add(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
    return allowed


def _torch_reason(exc: BaseException) -> str:
    text = str(exc)
    if "central directory" in text or isinstance(exc, OSError):
        return "not a complete torch.save archive"
    if isinstance(exc, EOFError) or not text:
        return "the file ends too early"
    if "Unsupported operand" in text or "load key" in text:
        return "not a valid pickle"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(exc).__name__
