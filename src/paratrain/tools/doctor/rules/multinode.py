"""What works on one machine and breaks on two: the global rank used as a device index, and
a rendezvous address that is one machine's address on one network."""

from __future__ import annotations

import ast
import ipaddress
import re
from collections.abc import Iterator

from paratrain.tools.doctor.names import DDP, INIT_PROCESS_GROUP
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script, keyword

_GET_RANK = ("torch.distributed.get_rank",)
#: the environment variables torchrun sets: the rank over every machine, and on this one
_GLOBAL, _LOCAL = "RANK", "LOCAL_RANK"
#: calls whose argument is a device index
_SET_DEVICE = ("torch.cuda.set_device", "torch.accelerator.set_device_index")
_GETENV = ("os.getenv",)


def _global_rank(script: Script, value: ast.expr) -> bool:
    """``int(os.environ["RANK"])``, ``os.environ.get("RANK")``, ``dist.get_rank()``."""
    func = value.func if isinstance(value, ast.Call) else None
    if isinstance(value, ast.Call) and isinstance(func, ast.Name) and func.id == "int":
        return bool(value.args) and _global_rank(script, value.args[0])
    if isinstance(value, ast.Call):
        if script.full_name(value.func) in _GET_RANK:
            return True
        if isinstance(value.func, ast.Attribute) and value.func.attr == "get" and value.args:
            return _is_constant(value.args[0], _GLOBAL)
    if isinstance(value, ast.Subscript):
        return _is_constant(value.slice, _GLOBAL)
    return False


def _is_constant(node: ast.AST, text: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == text


def _device_args(script: Script) -> Iterator[tuple[ast.AST, ast.expr]]:
    """``(call, the device index it is given)`` for set_device, .to(i), .cuda(i), DDP's
    device_ids=[i] and device_id=i."""
    for call in script.calls(*_SET_DEVICE):
        if call.args:
            yield call, call.args[0]
    for attr in ("to", "cuda"):
        for call in script.method_calls(attr):
            if len(call.args) == 1 and not call.keywords:
                yield call, call.args[0]
    for call in script.calls(DDP):
        ids = keyword(call, "device_ids", 1)
        if isinstance(ids, ast.List) and len(ids.elts) == 1:
            yield call, ids.elts[0]


def _rank_as_device(script: Script) -> Iterator[Hit]:
    local_read = any(_is_constant(n, _LOCAL) for n in script.nodes(ast.Constant))
    if not local_read:  # a script that never asks for its local rank may run on one machine
        return
    for call, index in _device_args(script):
        if not isinstance(index, ast.Name):
            continue
        assigned = script.assigned_in(script.scope(call), index.id)
        earlier = [v for v, s in assigned if s.lineno <= getattr(call, "lineno", 0)]
        if earlier and _global_rank(script, earlier[-1]):
            yield Hit(
                index,
                f"{index.id} is the global rank, used here as a device index: on a second "
                f"machine {index.id} runs past the GPUs of the node (invalid device ordinal), "
                "while the LOCAL_RANK the script reads goes unused",
                "index devices with the local rank: int(os.environ['LOCAL_RANK']) under "
                "torchrun (paratrain's launcher sets the device itself)",
            )


#: parameters and variables that hold where the processes meet
_ADDRESS_NAMES = re.compile(r"addr|url|ip|host|master|init|rdzv|endpoint", re.IGNORECASE)
_IP = re.compile(r"(\d{1,3}(?:\.\d{1,3}){3})")


def _private(text: object) -> str | None:
    """The LAN address ``text`` names (10/8, 172.16/12, 192.168/16; ``tcp://`` and a port
    allowed), if it names one."""
    if not isinstance(text, str):
        return None
    host = text.removeprefix("tcp://").split(":")[0]
    if not (match := _IP.fullmatch(host)):
        return None
    try:
        address = ipaddress.ip_address(match.group(1))
    except ValueError:
        return None
    lan = address.is_private and not (
        address.is_loopback or address.is_unspecified or address.is_link_local
    )
    return match.group(1) if lan else None


def _addresses(script: Script) -> Iterator[tuple[ast.AST, str]]:
    for call in script.calls(INIT_PROCESS_GROUP):
        method = keyword(call, "init_method", 1)
        if method is not None and (ip := _private(getattr(method, "value", None))):
            yield method, ip
    for node in script.nodes(ast.Assign):  # os.environ["MASTER_ADDR"] = "192.168.0.2"
        target = node.targets[0]
        if (
            isinstance(target, ast.Subscript)
            and _is_constant(target.slice, "MASTER_ADDR")
            and (ip := _private(getattr(node.value, "value", None)))
        ):
            yield node, ip
    # os.environ.setdefault("MASTER_ADDR", ip), and the default of a read of it:
    # os.environ.get("MASTER_ADDR", ip), os.getenv("MASTER_ADDR", ip)
    defaults = [*script.method_calls("setdefault"), *script.method_calls("get")]
    for call in [*defaults, *script.calls(*_GETENV)]:
        named = len(call.args) == 2 and _is_constant(call.args[0], "MASTER_ADDR")
        if named and (ip := _private(getattr(call.args[1], "value", None))):
            yield call, ip
    for call in script.method_calls("add_argument"):
        names = " ".join(str(getattr(a, "value", "")) for a in call.args)
        default = keyword(call, "default")
        value = getattr(default, "value", None)
        if default is not None and _ADDRESS_NAMES.search(names) and (ip := _private(value)):
            yield default, ip


def _lan_address(script: Script) -> Iterator[Hit]:
    for node, ip in _addresses(script):
        yield Hit(
            node,
            f"the processes meet at {ip}, one machine's address on one network: anywhere "
            "else the run waits for a machine that is not there (or joins a stranger's)",
            "take the address from the launcher (torchrun sets MASTER_ADDR; --rdzv-endpoint "
            "for several machines) and default to 127.0.0.1 on one machine (paratrain's "
            "launcher needs neither)",
        )


RULES = [
    Rule(
        "rank-as-device",
        "the global RANK used as a CUDA device index while LOCAL_RANK goes unused",
        _rank_as_device,
    ),
    Rule(
        "lan-address",
        "a rendezvous address (MASTER_ADDR, init_method, a --dist-url default) that is a LAN IP",
        _lan_address,
    ),
]
