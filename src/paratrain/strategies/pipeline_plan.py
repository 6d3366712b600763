"""Where a model is cut into pipeline stages, and the stage modules.

A split point is a submodule that starts a stage: ``features``/``classifier`` in a model,
``blocks.2`` in a transformer, ``3`` in an ``nn.Sequential``. The model's ``forward`` is
traced with ``torch.fx`` down to the split points only (every other module stays one call,
so its own code is never traced) and the graph is cut before each of them
(``split_module``). Each stage keeps the model's own submodules and parameters, under the
model's own names: a stage's ``state_dict`` keys are the full model's.

Without named split points the stages are chosen from the model's repeated layers (the
blocks of :mod:`.blocks`; an ``nn.Sequential`` block is opened when more stages are asked
for than there are blocks), balancing the parameter count of the stages.

Everything here is plain Python on one process: ``paratrain train`` checks a plan before
any process starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx, nn

from paratrain.strategies import decoder_stages, timm_stages
from paratrain.strategies.block_cut import block_starts, min_max_partition
from paratrain.strategies.blocks import default_blocks, has_parameters
from paratrain.utils.errors import UserError


def plan_stages(
    model: nn.Module, num_stages: int, split_points: Sequence[str] = ()
) -> list[nn.Module]:
    """The ``num_stages`` stage modules of ``model``, first to last, or ``UserError``."""
    if num_stages < 2:
        raise UserError(
            f"--strategy pipeline needs at least 2 stages (one per process), got {num_stages}"
        )
    if not has_parameters(model):
        raise UserError(f"--strategy pipeline splits layers, and {type(model).__name__} has none")
    layout = decoder_stages.decoder_layout(model)
    if layout is not None:  # a Hugging Face decoder: cut at its blocks, no tracing
        return _decoder_stages(model, layout, num_stages, split_points)
    image = timm_stages.image_layout(model)
    if image is not None:  # a timm ViT or ResNet: cut at its blocks, no tracing
        return _image_stages(model, image, num_stages, split_points)
    names = {id(module): name for name, module in model.named_modules()}
    if split_points:
        units = _named_units(model, split_points, num_stages)
    else:
        units = _layers(model, num_stages, names)
    traced = _trace(model, [names[id(unit)] for unit in units])
    order = _called_in_order(traced, [names[id(unit)] for unit in units], bool(split_points))
    points = order if split_points else _balanced_points(model, traced, order, num_stages)
    return _cut(model, traced, points)


def _decoder_stages(
    model: nn.Module,
    layout: decoder_stages.DecoderLayout,
    num_stages: int,
    split_points: Sequence[str],
) -> list[nn.Module]:
    kind = type(model).__name__
    unsupported = decoder_stages.unsupported_config(model, layout)
    if unsupported is not None:
        raise UserError(
            f"--strategy pipeline cuts {kind} at its blocks, but {unsupported}; train it "
            "with --strategy fsdp or ddp"
        )
    if split_points:
        _named_units(model, split_points, num_stages)
    blocks = decoder_stages.block_names(model, layout)
    weights = decoder_stages.segment_weights(model, layout)
    starts = block_starts(kind, blocks, weights, num_stages, split_points)
    return decoder_stages.build_stages(model, layout, starts)


def _image_stages(
    model: nn.Module,
    layout: timm_stages.ImageLayout,
    num_stages: int,
    split_points: Sequence[str],
) -> list[nn.Module]:
    if split_points:
        _named_units(model, split_points, num_stages)
    blocks = timm_stages.block_names(model, layout)
    weights = timm_stages.segment_weights(model, layout)
    aliases = timm_stages.aliases(layout, blocks)
    kind = type(model).__name__
    starts = block_starts(kind, blocks, weights, num_stages, split_points, aliases)
    return timm_stages.build_stages(model, layout, starts)


def _named_units(model: nn.Module, split_points: Sequence[str], num_stages: int) -> list[nn.Module]:
    modules = dict(model.named_modules())
    unknown = [name for name in split_points if name not in modules or name == ""]
    if unknown:
        raise UserError(
            f"--pipeline-split {','.join(unknown)}: {type(model).__name__} has no such "
            "submodule; name the modules that start stages 2, 3, ... (e.g. blocks.2)"
        )
    for outer in split_points:
        inner = next((name for name in split_points if name.startswith(outer + ".")), None)
        if inner is not None:
            raise UserError(
                f"--pipeline-split: {inner} lies inside {outer}; name split points that do "
                "not hold one another"
            )
    if len(split_points) != num_stages - 1:
        raise UserError(
            f"--pipeline-split names {len(split_points)} split point(s), which make "
            f"{len(split_points) + 1} stages, but the run has {num_stages} processes (one "
            f"per stage); name {num_stages - 1}"
        )
    return [modules[name] for name in split_points]


def _layers(model: nn.Module, num_stages: int, names: dict[int, str]) -> list[nn.Module]:
    """The model's repeated layers; Sequential ones opened until there are enough."""
    units = default_blocks(model)
    if not units and isinstance(model, nn.Sequential):
        units = [child for child in model.children() if has_parameters(child)]
    while len(units) < num_stages:
        openable = [
            unit
            for unit in units
            if isinstance(unit, nn.Sequential)
            and sum(has_parameters(child) for child in unit.children()) >= 2
        ]
        if not openable:
            break
        widest = max(openable, key=_parameter_count)
        at = units.index(widest)
        children = [child for child in widest.children() if has_parameters(child)]
        units[at : at + 1] = children
    if len(units) < num_stages:
        listed = ", ".join(names[id(unit)] for unit in units) or "none"
        raise UserError(
            f"--strategy pipeline with {num_stages} stages needs at least {num_stages} layers "
            f"to split between, and {type(model).__name__} has {len(units)} ({listed}); use "
            "fewer processes"
        )
    return units


class _SplitPointTracer(fx.Tracer):
    """Traces into a module only when a split point lies inside it."""

    def __init__(self, points: Sequence[str]) -> None:
        super().__init__()
        self._inside = {
            point.rsplit(".", depth)[0]
            for point in points
            for depth in range(1, point.count(".") + 1)
        }

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self._inside


def _trace(model: nn.Module, points: Sequence[str]) -> fx.GraphModule:
    try:
        graph = _SplitPointTracer(points).trace(model)
    except Exception as error:  # torch.fx raises many kinds for code it cannot follow
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"--strategy pipeline could not follow {type(model).__name__}.forward down to its "
            f"split points ({first}): its forward has control flow or calls that torch.fx "
            "cannot trace. Train it with --strategy fsdp (shards it across the processes, no "
            "tracing) or ddp; pipeline cuts an nn.Sequential, a model whose forward torch.fx "
            "follows, Hugging Face's GPT-2 and Llama causal LMs and timm's ViT and ResNet (at "
            "their blocks)"
        ) from None
    return fx.GraphModule(model, graph)


def _called_in_order(traced: fx.GraphModule, points: Sequence[str], named: bool) -> list[str]:
    calls = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    for point in points:
        count = calls.count(point)
        if count > 1:
            raise UserError(
                f"--strategy pipeline: {point} runs {count} times in one forward; a split "
                "point must run once"
            )
        if count == 0 and named:
            raise UserError(
                f"--pipeline-split {point}: the model's forward never calls it; name modules "
                "the forward runs"
            )
    ordered = [str(target) for target in calls if target in set(points)]
    if named and ordered != list(points):
        raise UserError(
            f"--pipeline-split {','.join(points)}: the forward runs them in the order "
            f"{','.join(ordered)}; name them in that order"
        )
    return ordered


def _balanced_points(
    model: nn.Module, traced: fx.GraphModule, order: Sequence[str], num_stages: int
) -> list[str]:
    """The split points among ``order`` (the layers, as called) that make the stages'
    parameter counts most even: the largest stage as small as it can be."""
    if len(order) < num_stages:
        raise UserError(
            f"--strategy pipeline with {num_stages} stages needs at least {num_stages} layers "
            f"its forward runs, and {type(model).__name__} runs {len(order)}; use fewer processes"
        )
    weights = _segment_weights(model, traced, order)
    best = min_max_partition(weights, num_stages)
    return [order[start] for start in best]


def _segment_weights(model: nn.Module, traced: fx.GraphModule, order: Sequence[str]) -> list[int]:
    """Parameters from each layer's call up to the next one's (the first takes what
    precedes it too)."""
    starts = set(order)
    weights = [0] * len(order)
    index = 0
    seen: set[int] = set()
    for node in traced.graph.nodes:
        if node.op == "call_module" and node.target in starts:
            index = order.index(str(node.target))
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            params = list(model.get_submodule(str(node.target)).parameters())
        elif node.op == "get_attr":
            found = _attribute(model, str(node.target))
            params = [found] if isinstance(found, nn.Parameter) else []
        for param in params:
            if id(param) not in seen:
                seen.add(id(param))
                weights[index] += param.numel()
    return weights


def _attribute(model: nn.Module, target: str) -> object:
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name, None)


def _cut(model: nn.Module, traced: fx.GraphModule, points: Sequence[str]) -> list[nn.Module]:
    """One GraphModule per stage: the nodes from one split point to the next, taking what
    the stage before returns. GraphModule copies the modules a graph calls under their
    qualified names, so the stages hold the model's own modules under the model's names."""
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in traced.graph.nodes:
        if node.op == "call_module" and node.target in points:
            current = list(points).index(str(node.target)) + 1
        stage_of[node] = -1 if node.op == "placeholder" else current
    count = len(points) + 1
    crossing = _crossing_values(model, traced, stage_of, points)
    stages: list[nn.Module] = []
    for index in range(count):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs = (
            crossing[index] if index else [n for n in traced.graph.nodes if n.op == "placeholder"]
        )
        for node in inputs:
            env[node] = graph.placeholder(node.name)

        def lookup(
            node: fx.Node, graph: fx.Graph = graph, env: dict[fx.Node, fx.Node] = env
        ) -> fx.Node:
            if node not in env:  # only attribute reads are not yet here (see _crossing_values)
                env[node] = graph.get_attr(str(node.target))
            return env[node]

        for node in traced.graph.nodes:
            if stage_of[node] == index and node.op not in ("output", "get_attr"):
                env[node] = graph.node_copy(node, lookup)
        if index + 1 < count:
            sent = [env[node] for node in crossing[index + 1]]
            graph.output(sent[0] if len(sent) == 1 else tuple(sent))
        else:
            result = next(node for node in traced.graph.nodes if node.op == "output")
            graph.output(fx.map_arg(result.args[0], lookup))
        stages.append(fx.GraphModule(model, graph, class_name=f"Stage{index}"))
    _check_no_shared_parameters(model, stages, points)
    return stages


def _crossing_values(
    model: nn.Module, traced: fx.GraphModule, stage_of: dict[fx.Node, int], points: Sequence[str]
) -> list[list[fx.Node]]:
    """For each stage, the values it takes from the stage before, in order; ``UserError``
    when a stage needs anything else (the model's inputs, or an earlier stage's values)."""
    last = len(points)
    crossing: list[list[fx.Node]] = [[] for _ in range(last + 1)]
    for node in traced.graph.nodes:
        user = last + 1 if node.op == "output" else stage_of[node]
        for source in node.all_input_nodes:
            made = stage_of[source]
            if source.op == "get_attr" or made == user:
                continue
            if made == -1 and user == 0:
                continue
            if node.op == "output" and made == last:
                continue
            if made != user - 1:
                needs = "the model's output" if node.op == "output" else f"stage {user + 1}"
                where = "the model's inputs" if made == -1 else f"stage {made + 1}"
                raise UserError(
                    f"--strategy pipeline: cut at {','.join(points)}, {needs} of "
                    f"{type(model).__name__} needs a value from {where}, but a pipeline passes "
                    "each stage only what the stage before returns; choose other split points"
                )
            if source not in crossing[user]:
                crossing[user].append(source)
    return crossing


def _check_no_shared_parameters(
    model: nn.Module, stages: Sequence[nn.Module], points: Sequence[str]
) -> None:
    owner: dict[int, int] = {}
    for index, stage in enumerate(stages):
        for param in stage.parameters():
            if owner.setdefault(id(param), index) != index:
                raise UserError(
                    f"--strategy pipeline: {type(model).__name__} shares a parameter between "
                    f"stages {owner[id(param)] + 1} and {index + 1} (tied weights); choose split "
                    "points that keep tied layers in one stage"
                )


def _parameter_count(module: nn.Module) -> int:
    return sum(param.numel() for param in module.parameters())


def batchnorm_refusal(model: nn.Module, microbatches: int) -> str | None:
    """Why the pipeline refuses ``model``'s BatchNorm, if it does: each micro-batch would be
    normalized with its own statistics, and the running ones counted once per micro-batch,
    a different model from one process's. One micro-batch per batch keeps it exact."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or microbatches <= 1:
        return None
    return (
        f"--strategy pipeline cuts each batch into {microbatches} micro-batches, and "
        f"{type(model).__name__} has BatchNorm ({len(norms)} layers), which would "
        "normalize each with its own statistics: a different model from one "
        "process's. Use --pipeline-microbatches 1 (exact, stages run in turn), "
        "another layout (ddp, fsdp), or GroupNorm/LayerNorm"
    )
