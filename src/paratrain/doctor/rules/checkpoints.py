"""Saving the state_dict of a DataParallel/DDP-wrapped model: every key gets ``module.``."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from paratrain.doctor.names import ACCELERATOR, DATA_PARALLEL, DDP, RUNTIME, TORCH_SAVE, dotted
from paratrain.doctor.rules.base import Hit, Rule
from paratrain.doctor.script import Script, own_nodes


def _instances(script: Script, cls: str) -> set[str]:
    return {
        name
        for node in ast.walk(script.tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and script.full_name(node.value.func) == cls
        for t in node.targets
        if (name := dotted(t)) is not None
    }


def _models(script: Script) -> set[str]:
    """Names whose parameters are taken somewhere: models, not optimizers or loaders."""
    return {
        owner
        for node in ast.walk(script.tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("parameters", "named_parameters")
        and (owner := dotted(node.func.value)) is not None
    }


def _wrapping(script: Script, scope: ast.AST) -> list[tuple[int, str, bool]]:
    """``(line, name, wrapped)`` for every assignment of ``scope``: whether the name then
    holds a wrapped model (DDP/DataParallel, accelerator.prepare, rt.setup) or not."""
    preparers = _instances(script, ACCELERATOR) | _instances(script, RUNTIME)
    models = _models(script)
    events: list[tuple[int, str, bool]] = []
    for node in own_nodes(scope):
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        for target in node.targets:
            targets = target.elts if isinstance(target, ast.Tuple) else [target]
            for index, element in enumerate(targets):
                name = dotted(element)
                if name is None:
                    continue
                wrapped = False
                if isinstance(value, ast.Call):
                    full = script.full_name(value.func)
                    if (full in (DDP, DATA_PARALLEL) and len(targets) == 1) or (
                        isinstance(value.func, ast.Attribute)
                        and value.func.attr in ("prepare", "setup")
                        and dotted(value.func.value) in preparers
                        and index < len(value.args)
                        and dotted(value.args[index]) in models
                    ):
                        wrapped = True
                events.append((node.lineno, name, wrapped))
    return sorted(events)


def _wrapped_at(events: list[tuple[int, str, bool]], name: str, line: int) -> bool:
    state = False
    for at, target, wrapped in events:
        if at < line and target == name:
            state = wrapped
    return state


def _state_dict_owners(node: ast.AST) -> list[str]:
    return [
        owner
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "state_dict"
        and (owner := dotted(n.func.value)) is not None
    ]


def _wrapped_state_dict(script: Script) -> Iterator[Hit]:
    savers = {f"{name}.save" for name in _instances(script, ACCELERATOR)}
    scopes: list[ast.AST] = [script.tree]
    scopes += [f for defs in script.functions().values() for f in defs]
    for scope in scopes:
        events = _wrapping(script, scope)
        if not any(wrapped for _, _, wrapped in events):
            continue
        # what each name was last assigned from, to follow `state = model.state_dict()`
        values = [
            (node.lineno, dotted(t), node.value)
            for node in own_nodes(scope)
            if isinstance(node, ast.Assign)
            for t in node.targets
        ]
        for call in own_nodes(scope):
            if not isinstance(call, ast.Call) or not call.args:
                continue
            if script.full_name(call.func) != TORCH_SAVE and dotted(call.func) not in savers:
                continue
            saved = call.args[0]
            owners = _state_dict_owners(saved)
            for name in {dotted(n) for n in ast.walk(saved)} - {None}:
                earlier = [v for line, t, v in values if t == name and line < call.lineno]
                if earlier:
                    owners += _state_dict_owners(earlier[-1])
            for owner in dict.fromkeys(owners):
                if _wrapped_at(events, owner, call.lineno):
                    yield Hit(
                        call,
                        f"{owner} is wrapped (DataParallel/DDP), so every key of "
                        f"{owner}.state_dict() starts with 'module.' and a bare model "
                        "cannot load it",
                        f"save {owner}.module.state_dict() (Accelerate: "
                        "accelerator.unwrap_model(model).state_dict(); paratrain: rt.save "
                        "writes plain names, and paratrain.load_weights reads either)",
                    )


RULES = [
    Rule(
        "wrapped-state-dict",
        "state_dict() of a wrapped model saved with 'module.' keys",
        _wrapped_state_dict,
    ),
]
