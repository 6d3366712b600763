"""A script read with the local modules it imports: the project, not the file.

``import utils``, ``import util.misc as utils``, ``from engine import evaluate``, ``from .
import x`` and ``from utils import *`` are looked up beside the script and in the folders
above it up to the project's root (the folder doctor was given, else the script's own);
each module found is parsed once with the same index, and so are the modules it imports.
A star import lends its names: ``from utils import *`` of a module that does ``import
torch.distributed as dist`` makes ``dist`` resolve in the script. What is not found there
(an installed library, a module of another folder) stays unread: rules that would need it
stay silent.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from paratrain.tools.doctor.script import Function, Script
from paratrain.utils.errors import UserError

#: files read for one project at most (a runaway guard), and the largest module read (bytes)
_MODULES = 5000
_LARGEST = 2_000_000


class Project:
    """The scripts of one run of doctor, each parsed once and linked to its local imports."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root.resolve() if root is not None else None
        self._read: dict[Path, Script | None] = {}

    def script(self, path: Path) -> Script:
        """``path`` parsed and linked (a ``UserError`` for a file Python cannot read)."""
        file = path.resolve()
        cached = self._read.get(file)
        if cached is not None:
            cached.path = str(path)  # read first as a module: named as the user named it
            return cached
        script = Script.read(path)
        self._read[file] = script
        self._link(script, file)
        return script

    def _module(self, file: Path) -> Script | None:
        """A module imported by a script: parsed once; None when unreadable or too many."""
        if file in self._read:
            return self._read[file]
        self._read[file] = None  # also breaks import cycles while it is linked
        if len(self._read) > _MODULES or file.stat().st_size > _LARGEST:
            return None
        try:
            module = Script.read(_shown(file))
        except UserError:
            return None
        self._read[file] = module
        self._link(module, file)
        return module

    def _folders(self, file: Path) -> list[Path]:
        """Where an absolute import of ``file`` is looked for: its folder, then the folders
        above it up to the root."""
        folders = [file.parent]
        if self.root is not None and file.parent.is_relative_to(self.root):
            folder = file.parent
            while folder != self.root:
                folder = folder.parent
                folders.append(folder)
        return folders

    def _find(self, file: Path, module: str, level: int) -> Path | None:
        parts = module.split(".") if module else []
        if level:
            bases = [file.parents[level - 1]] if level <= len(file.parents) else []
        else:
            bases = self._folders(file)
        for base in bases:
            target = base.joinpath(*parts) if parts else base
            for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                if parts and candidate.is_file():
                    return candidate
            if not parts and (target / "__init__.py").is_file():
                return target / "__init__.py"
        return None

    def _link(self, script: Script, file: Path) -> None:
        for node in _imports(script):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self._add(script, file, alias.name, 0, alias.name)
                continue
            base = node.module or ""
            for alias in node.names:
                if alias.name == "*":
                    self._star(script, file, base, node.level)
                    continue
                # `from util import misc`: a module; `from engine import evaluate`: a name
                inner = f"{base}.{alias.name}" if base else alias.name
                if not self._add(script, file, inner, node.level, _bound(node, inner)):
                    self._add(script, file, base, node.level, _bound(node, base))
        script.modules = [script, *_closure(script)]

    def _add(self, script: Script, file: Path, name: str, level: int, key: str) -> bool:
        found = self._find(file, name, level)
        module = self._module(found) if found is not None else None
        if module is not None:
            script.local[key] = module
        return module is not None

    def _star(self, script: Script, file: Path, name: str, level: int) -> None:
        found = self._find(file, name, level)
        module = self._module(found) if found is not None else None
        if module is None:
            return
        script.star.append(module)
        defined = {f.name for f in script.all_functions} | set(script.assigned)
        for local, full in module.imports.items():
            if local not in script.imports and local not in defined:
                script.imports[local] = full
        for local, other in module.local.items():
            script.local.setdefault(local, other)


def _shown(file: Path) -> Path:
    """``file`` relative to the working folder when it is under it (as messages name it)."""
    try:
        return file.relative_to(Path.cwd())
    except ValueError:
        return file


def _bound(node: ast.ImportFrom, name: str) -> str:
    """The key a module is kept under: its full dotted name, as the import table spells it
    (``util.misc``, ``.train_utils``)."""
    return ("." * node.level) + name


def _imports(script: Script) -> Iterable[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = [
        *script.nodes(ast.Import),
        *script.nodes(ast.ImportFrom),
    ]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _closure(script: Script) -> list[Script]:
    """The local modules ``script`` reaches through its imports, each once."""
    seen: dict[int, Script] = {id(script): script}
    todo = [*script.local.values(), *script.star]
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen[id(module)] = module
        todo.extend([*module.local.values(), *module.star])
    return [m for m in seen.values() if m is not script]


def imported(script: Script, name: str) -> tuple[Script, Function] | None:
    """The module and function a call's full name (``utils.init_distributed_mode``,
    ``engine.evaluate``) or a star-imported bare name stands for, when doctor read it."""
    module_name, _, function = name.rpartition(".")
    modules = [script.local[module_name]] if module_name in script.local else []
    if not module_name:
        modules = list(script.star)
    for module in modules:
        found = module.functions().get(function)
        if found:
            return module, found[0]
    return None


def imported_function(script: Script, name: str) -> Function | None:
    found = imported(script, name)
    return found[1] if found is not None else None


def imported_class(script: Script, name: str) -> tuple[Script, ast.ClassDef] | None:
    """The module and class a full name (``trainer.Trainer``) stands for, when read."""
    module_name, _, cls = name.rpartition(".")
    modules = [script.local[module_name]] if module_name in script.local else list(script.star)
    for module in modules:
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return module, node
    return None
