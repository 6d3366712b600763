"""Which calls are collectives (every process must make them), and which loaders shard.

A collective is ``torch.distributed``'s (``all_reduce``, ``barrier``...), Horovod's
(``hvd.allreduce``...), or a method of a paratrain Runtime (``rt.save``, ``rt.all_reduce``),
an Accelerator (``gather``, ``wait_for_everyone``...) or a Fabric (``all_reduce``, ``save``...);
a function or method of the file that makes one is a collective too.
"""

from __future__ import annotations

import ast
from functools import cached_property

from paratrain.tools.doctor.names import (
    ACCELERATOR,
    DATA_LOADER,
    DISTRIBUTED_SAMPLER,
    FABRIC,
    RUNTIME,
    dotted,
)
from paratrain.tools.doctor.script import Script, keyword

_TORCH = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
    "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all",
    "monitored_barrier",
}  # fmt: skip
_HOROVOD = {
    "allreduce", "allreduce_", "allgather", "allgather_object", "broadcast", "broadcast_",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "alltoall",
    "barrier", "join",
}  # fmt: skip
_BY_OWNER = {
    RUNTIME: {"save", "all_reduce", "all_gather", "barrier", "broadcast"},
    ACCELERATOR: {"gather", "gather_for_metrics", "reduce", "wait_for_everyone", "save_state"},
    FABRIC: {"all_reduce", "all_gather", "barrier", "broadcast", "save"},
}
#: helpers of libraries that shard a plain DataLoader over the processes
SHARDING_HELPERS = {"setup_loader", "prepare", "prepare_data_loader", "setup_dataloaders"}


class Collectives:
    @classmethod
    def of(cls, script: Script) -> Collectives:
        """One per script, shared by the rules that ask."""
        if "collectives" not in script.memo:
            script.memo["collectives"] = cls(script)
        found: Collectives = script.memo["collectives"]
        return found

    def __init__(self, script: Script) -> None:
        self.script = script
        self._owners = {
            name: methods for cls, methods in _BY_OWNER.items() for name in script.instances(cls)
        }

    def direct(self, call: ast.Call) -> bool:
        full = self.script.full_name(call.func) or ""
        last = full.rpartition(".")[2]
        if full.startswith("torch.distributed.") and last in _TORCH:
            return True
        if full.startswith("horovod.") and last in _HOROVOD:
            return True
        func = call.func
        if isinstance(func, ast.Attribute):
            owner = dotted(func.value)
            return owner is not None and func.attr in self._owners.get(owner, set())
        return False

    @cached_property
    def _helpers(self) -> tuple[set[str], set[str]]:
        """(functions, method names) of the file that make a collective, at any depth."""
        script = self.script
        functions: set[str] = set()
        methods: set[str] = set()
        # calls from functions, and which of them are collectives themselves
        inside = [
            (call, self.direct(call))
            for call in script.nodes(ast.Call)
            if isinstance(script.scope(call), ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        changed = True
        while changed:  # a few rounds: one per level of helper calling helper
            changed = False
            for call, direct in inside:
                if not (direct or self._helper_call(call, functions, methods)):
                    continue
                scope = script.scope(call)
                if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                found = methods if script.in_class(scope) else functions
                if scope.name not in found:
                    found.add(scope.name)
                    changed = True
        return functions, methods

    def _helper_call(self, call: ast.Call, functions: set[str], methods: set[str]) -> bool:
        func = call.func
        if isinstance(func, ast.Name):
            return func.id in functions
        # `th.save(...)` is torch's, not the file's own `def save(self)` that has a barrier
        imported = self.script.full_name(func) is not None
        return isinstance(func, ast.Attribute) and func.attr in methods and not imported

    def is_collective(self, call: ast.Call) -> bool:
        functions, methods = self._helpers
        return self.direct(call) or self._helper_call(call, functions, methods)


def sharded_loaders(script: Script) -> set[str]:
    """Names of loaders that give each process its own share of the data: built with a
    DistributedSampler, or prepared by Accelerate/Fabric/paratrain (``evaluation=True``
    too: each sample once over all processes, so each process still sums a share)."""
    samplers = {
        name
        for call in script.calls(DISTRIBUTED_SAMPLER)
        if isinstance(parent := script.parents.get(call), ast.Assign)
        for t in parent.targets
        if (name := dotted(t)) is not None
    }
    found: set[str] = set()
    for loader in script.calls(DATA_LOADER):
        sampler = keyword(loader, "sampler", 3)
        if sampler is None:
            continue
        is_distributed = dotted(sampler) in samplers or (
            isinstance(sampler, ast.Call) and script.full_name(sampler.func) == DISTRIBUTED_SAMPLER
        )
        parent = script.parents.get(loader)
        if is_distributed and isinstance(parent, ast.Assign):
            found.update(n for t in parent.targets if (n := dotted(t)) is not None)
    for helper in SHARDING_HELPERS:
        for call in script.method_calls(helper):
            parent = script.parents.get(call)
            if not isinstance(parent, ast.Assign):
                continue
            for target in parent.targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                found.update(n for e in elements if (n := dotted(e)) is not None)
    return found
