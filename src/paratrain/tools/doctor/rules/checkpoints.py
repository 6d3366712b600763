"""Saving the state_dict of a wrapped or compiled model: every key gets ``module.`` or
``_orig_mod.``, and a bare model cannot load it."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.tools.doctor.names import ACCELERATOR, TORCH_SAVE, dotted
from paratrain.tools.doctor.rules.base import Hit, Rule
from paratrain.tools.doctor.script import Script
from paratrain.tools.doctor.wrappers import COMPILE, WRAP, Wrappers

_FOLLOW = 3  # how many `name = ...` steps to follow back from what is saved


def saves(script: Script) -> Iterator[tuple[ast.Call, ast.expr]]:
    """``(call, what it saves)``: torch.save, accelerator.save, and calls of the file's own
    helpers that pass a parameter to torch.save (``save_checkpoint({...}, is_best)``)."""
    savers = {f"{name}.save" for name in script.instances(ACCELERATOR)}
    direct = [
        call
        for call in script.nodes(ast.Call)
        if call.args and (script.full_name(call.func) == TORCH_SAVE or dotted(call.func) in savers)
    ]
    yield from ((call, call.args[0]) for call in direct)
    helpers: dict[str, int] = {}
    for call in direct:
        function = script.scope(call)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) and not script.in_class(
            function
        ):
            params = [a.arg for a in function.args.args]
            saved = dotted(call.args[0])
            if saved in params:
                helpers[function.name] = params.index(saved)
    if helpers:
        for call in script.nodes(ast.Call):
            func = call.func
            if (
                isinstance(func, ast.Name)
                and func.id in helpers
                and len(call.args) > helpers[func.id]
            ):
                yield call, call.args[helpers[func.id]]


def _state_dicts(script: Script, saved: ast.expr, at: ast.AST) -> list[tuple[ast.expr, ast.AST]]:
    """``(owner, where)`` for each ``owner.state_dict()`` in ``saved``, following the names
    it is built from (``state = {"model": model.state_dict()}``) in the same function."""
    found: list[tuple[ast.expr, ast.AST]] = []
    todo: list[tuple[ast.expr, ast.AST, int]] = [(saved, at, 0)]
    scope = script.scope(at)
    while todo:
        expr, where, depth = todo.pop()
        for node in ast.walk(expr):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "state_dict"
            ):
                found.append((node.func.value, where))
            elif depth < _FOLLOW and isinstance(node, ast.Name):
                line = getattr(where, "lineno", 0)
                earlier = [(v, s) for v, s in script.assigned_in(scope, node.id) if s.lineno < line]
                if earlier:
                    value, statement = earlier[-1]
                    todo.append((value, statement, depth + 1))
    return found


def _prefixed(script: Script, want: str) -> list[tuple[ast.Call, str]]:
    if "prefixed" not in script.memo:
        script.memo["prefixed"] = _saved_layers(script)
    return [(call, text) for call, text, layer in script.memo["prefixed"] if layer == want]


def _saved_layers(script: Script) -> list[tuple[ast.Call, str, str]]:
    """``(save call, owner, outermost layer)`` for each wrapped or compiled state_dict saved."""
    wrappers = Wrappers(script)
    if not wrappers.any_wrapping():
        return []
    found: dict[tuple[int, str, str], tuple[ast.Call, str, str]] = {}
    for call, saved in saves(script):
        statement = script.statement(call)
        for owner, where in _state_dicts(script, saved, statement):
            text = dotted(owner) or ast.unparse(owner)
            for layer in {v[0] for v in wrappers.of(owner, where) if v}:
                found.setdefault((id(call), text, layer), (call, text, layer))
    return list(found.values())


def _unwrapped_saved(script: Script) -> set[tuple[int, str]]:
    """(function, model) where that function also saves the model's unwrapped state
    (``model.module.backbone.state_dict()``): its wrapped state_dict is a resume checkpoint,
    'module.' keys and all, by design (Barlow Twins, VICReg save both in one function)."""
    found: set[tuple[int, str]] = set()
    for call, saved in saves(script):
        statement = script.statement(call)
        for owner, _ in _state_dicts(script, saved, statement):
            name = dotted(owner)
            if name is not None and ".module" in name:
                found.add((id(script.scope(call)), name.split(".module")[0]))
    return found


def _wrapped_state_dict(script: Script) -> Iterator[Hit]:
    exported = _unwrapped_saved(script)
    for call, owner in _prefixed(script, WRAP):
        if (id(script.scope(call)), owner) in exported:
            continue
        yield Hit(
            call,
            f"{owner} is wrapped (DataParallel/DDP), so every key of {owner}.state_dict() "
            "starts with 'module.' and a bare model cannot load it (KeyError)",
            f"save {owner}.module.state_dict() (Accelerate: "
            "accelerator.unwrap_model(model).state_dict(); paratrain: rt.save writes plain "
            "names, and paratrain.load_weights reads either)",
        )


def _compiled_state_dict(script: Script) -> Iterator[Hit]:
    for call, owner in _prefixed(script, COMPILE):
        yield Hit(
            call,
            f"{owner} is a torch.compile'd model, so every key of {owner}.state_dict() "
            "starts with '_orig_mod.' and an uncompiled model cannot load it (KeyError)",
            f"save {owner}._orig_mod.state_dict() (or keep the uncompiled model in its own "
            "name and save that; paratrain's rt.save and load_weights strip both prefixes)",
        )


RULES = [
    Rule(
        "wrapped-state-dict",
        "state_dict() of a wrapped model saved with 'module.' keys",
        _wrapped_state_dict,
    ),
    Rule(
        "compiled-state-dict",
        "state_dict() of a torch.compile'd model saved with '_orig_mod.' keys",
        _compiled_state_dict,
    ),
]
