"""What a running job looks like from outside: its process tree and the TCP sockets it
listens on, read from /proc (Linux), as ``ss -ltnp`` would show them."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def state(pid: int) -> str | None:
    """The process's state letter (R, S, Z...), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    return state(pid) not in (None, "Z", "X")


def descendants(root: int) -> list[int]:
    """``root``'s children, their children, and so on (not ``root`` itself)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _command(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def is_rank_process(pid: int) -> bool:
    """A process ``rt.launch`` started: spawned (``spawn_main``), forked from the fork
    server (paratrain.launching.rank_start), whose children share its command line, or
    forked from paratrain's command itself (the same command line as its parent's, whose
    own parent's differs: not a data-loading worker of such a process)."""
    command = _command(pid)
    if b"spawn_main" in command:
        return True
    parent = parent_of(pid)
    if parent is None:
        return False
    if b"forkserver" in command:
        return b"forkserver" in _command(parent)
    grandparent = parent_of(parent)
    return (
        b"paratrain" in command
        and command == _command(parent)
        and (grandparent is None or _command(grandparent) != command)
    )


def rank_processes(root: int) -> list[int]:
    """The processes below ``root`` that ``rt.launch`` started, oldest first."""
    return sorted(pid for pid in descendants(root) if is_rank_process(pid))


def _socket_inodes(pids: list[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _address(hex_address: str, six: bool) -> str:
    raw = bytes.fromhex(hex_address)
    if not six:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    inodes = _socket_inodes(pids)
    found = []
    for table, six in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((_address(address, six), int(port, 16)))
    return found


def exposed(listeners: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The listeners reachable from other machines (not on a loopback address)."""
    return [(a, p) for a, p in listeners if not (a.startswith("127.") or a == "::1")]
