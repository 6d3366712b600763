"""Where tensors and models are put: created on the CPU then copied (seed 002), the
optimizer built before the model moves (seed 003), DataParallel around a CPU model."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.hints import moves_to_device
from paratrain.tools.doctor.names import DATA_PARALLEL, dotted
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script, has_kwargs_splat, keyword

#: factories that take ``device=``
FACTORIES = {
    f"torch.{name}"
    for name in [
        "rand",
        "randn",
        "randint",
        "randperm",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "linspace",
        "logspace",
        "eye",
        "tensor",
    ]
}


def _create_then_move(script: Script) -> Iterator[Hit]:
    for node in script.nodes(ast.Call):
        if not moves_to_device(script, node):
            continue
        assert isinstance(node.func, ast.Attribute)
        made = node.func.value
        if not isinstance(made, ast.Call) or script.full_name(made.func) not in FACTORIES:
            continue
        if keyword(made, "device") is not None or has_kwargs_splat(made):
            continue
        factory = ast.unparse(made.func)
        often = " on every iteration" if script.loops_around(node) else ""
        yield Hit(
            node,
            f"{factory}(...) is created on the CPU, then copied to the device by "
            f".{node.func.attr}(){often}",
            f"create it where it is used: {factory}(..., device=device)",
        )


def _optimizer_before_move(script: Script) -> Iterator[Hit]:
    scopes: list[ast.AST] = [script.tree, *script.all_functions]
    for scope in scopes:
        built: dict[str, int] = {}  # model -> line of the first optimizer built from it
        for node in script.own(scope):
            if not isinstance(node, ast.Call):
                continue
            full = script.full_name(node.func) or ""
            if full.startswith("torch.optim.") and not full.startswith("torch.optim.lr_"):
                params = keyword(node, "params", 0)
                for owner in _parameter_owners(params):
                    built[owner] = min(built.get(owner, node.lineno), node.lineno)
        for node in script.own(scope):
            if not isinstance(node, ast.Call) or not moves_to_device(script, node):
                continue
            assert isinstance(node.func, ast.Attribute)
            model = dotted(node.func.value)
            if model is not None and model in built and node.lineno > built[model]:
                yield Hit(
                    node,
                    f"the optimizer (line {built[model]}) was built before {model} was moved "
                    "to the device",
                    f"move {model} first, then build the optimizer from its parameters "
                    "(paratrain's rt.setup(model, optimizer) handles either order)",
                )


def _parameter_owners(params: ast.expr | None) -> set[str]:
    """``m`` for every ``m.parameters()`` / ``m.named_parameters()`` in ``params``."""
    if params is None:
        return set()
    return {
        owner
        for n in ast.walk(params)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("parameters", "named_parameters")
        and (owner := dotted(n.func.value)) is not None
    }


def _dataparallel_on_cpu(script: Script) -> Iterator[Hit]:
    moved: set[str] = set()
    for node in script.nodes(ast.Call):
        if moves_to_device(script, node):
            assert isinstance(node.func, ast.Attribute)
            if (name := dotted(node.func.value)) is not None:
                moved.add(name)
            elif isinstance(node.func.value, ast.Call):  # DataParallel(model).cuda()
                moved.add(ast.unparse(node.func.value))
            parent = script.parents.get(node)
            if isinstance(parent, ast.Assign):  # model = Net().to(device)
                moved.update(d for t in parent.targets if (d := dotted(t)) is not None)
    for call in script.calls(DATA_PARALLEL):
        module = keyword(call, "module", 0)
        wrapped = dotted(module) if module is not None else None
        parent = script.parents.get(call)
        target = dotted(parent.targets[0]) if isinstance(parent, ast.Assign) else None
        if module is None or isinstance(module, ast.Call) or has_kwargs_splat(call):
            continue  # DataParallel(model.cuda()) and friends
        if wrapped is None or {wrapped, target, ast.unparse(call)} & moved:
            continue
        # `model.features = DataParallel(model.features)`, then `model.cuda()` moves it too
        if any(wrapped.startswith(m + ".") for m in moved):
            continue
        yield Hit(
            call,
            f"nn.DataParallel wraps {wrapped}, which is never moved to a GPU: with GPUs "
            "DataParallel refuses it (its parameters must be on device_ids[0]); without, "
            "nothing runs in parallel",
            f"move it first: {wrapped}.to('cuda'), then wrap it (paratrain: "
            "Runtime(strategy='dp').setup(model) does both)",
        )


RULES = [
    Rule(
        "create-then-move",
        "a tensor created on the CPU, then copied to the device",
        _create_then_move,
    ),
    Rule(
        "optimizer-before-move",
        "an optimizer built before the model is moved",
        _optimizer_before_move,
    ),
    Rule(
        "dataparallel-on-cpu",
        "nn.DataParallel around a model never moved to a GPU",
        _dataparallel_on_cpu,
    ),
]
