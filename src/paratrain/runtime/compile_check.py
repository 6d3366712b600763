"""The compiled model's gradients checked against eager ones, once, on the first step.

``torch.compile`` can compute wrong gradients while the loss matches eager exactly (on torch
2.13's CPU inductor, a Conv-ReLU-Conv-ReLU-MaxPool network gets all-zero gradients for its
convolutions: pytorch's issues labelled "module: correctness (silent)"). A speed option must
not change the model, so on the first training forward the compiled model's inputs are kept
and hooks catch the gradient that reaches its outputs; after that first ``rt.backward``, the
same inputs go through the eager model and ``torch.autograd.grad`` with those output
gradients gives the eager parameter gradients for the very same loss, whatever the loss
function. Under ``ddp`` the eager ones are averaged over the processes as DDP averaged the
compiled ones.

Per parameter the difference is ``|compiled - eager| / |eager|`` (norms; the denominator is
at least 1e-3 of the largest parameter's, so a parameter with almost no gradient cannot
dominate). Under bf16 or fp16 the two also round differently: on an H200, eager bf16
ResNet-18 gradients of BatchNorm parameters are 0.44 (relative) from float32 ones, and
inductor's 0.39, so compiled and eager differ by 0.33 while neither is worse. Beyond the
precision's tolerance (:data:`TOLERANCES`), a low-precision run therefore takes one more eager
pass in float32 and keeps the compiled model when, for every parameter, the compiled
gradients are no further from float32 than :data:`ROUNDING_MARGIN` times eager's distance
(or the tolerance). Beyond that, or beyond the tolerance in float32, the run falls back to eager:
the step's gradients are replaced by the eager ones, every later forward runs eager, and the
main process prints one line naming the worst parameter. ``compile="strict"`` (``--compile
strict``) raises instead. When they agree, one line gives the difference and what the check
cost next to the compile time.

Not checked: a forward that draws random numbers (dropout): the compiled and eager models
draw different masks, so their gradients differ by design; the line says so. Nor ``fsdp``,
whose sharded parameters' hooks would run in the eager pass too.
A test makes the compiled gradients wrong, as the inductor bug does, through the
``compiled_grads`` fault injection point (:mod:`paratrain.utils.injection`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from paratrain.distributed.collective import Collective
from paratrain.utils import injection
from paratrain.utils.errors import UserError

#: the largest relative gradient difference taken as agreement, per precision
TOLERANCES = {"32": 1e-3, "bf16": 5e-2, "fp16": 2e-2}
#: under bf16/fp16, how much further from float32 than eager the compiled gradients may be
ROUNDING_MARGIN = 1.5
#: the precisions whose compiled and eager gradients round differently
ROUNDED = ("bf16", "fp16")
#: steps whose gradients are not finite (fp16's first scaled steps) are not compared; after
#: this many, the check gives up
_ATTEMPTS = 5


class Rounding(NamedTuple):
    """Under bf16/fp16, the parameter whose compiled gradients are furthest from float32,
    relative to how far eager's are: its name, both distances, and whether that is within
    :data:`ROUNDING_MARGIN` (or the tolerance) on every process."""

    name: str
    compiled: float
    eager: float
    within: bool


class CompileCheck:
    """Wraps the compiled module's forward; :meth:`after_backward` runs the comparison."""

    def __init__(
        self,
        compiled: nn.Module,
        *,
        strict: bool,
        precision: str,
        collective: Collective,
        autocast: Callable[[], AbstractContextManager[Any]],
        compile_time: Callable[[], tuple[int, float]],
    ) -> None:
        """``compile_time``: graphs compiled and seconds spent so far (for the note)."""
        self.compiled = compiled
        #: what the compiled module runs: DDP(model) or the model itself
        self.eager: nn.Module = compiled._orig_mod  # type: ignore[assignment]
        self.plain: nn.Module = getattr(self.eager, "module", self.eager)
        self.strict = strict
        self.tolerance = TOLERANCES.get(precision, TOLERANCES["32"])
        self.precision = precision
        self.rounding: Rounding | None = None
        self.collective = collective
        self.autocast = autocast
        self.compile_time = compile_time
        #: "waiting" -> "pending" (first forward seen) -> "agreed" | "fell back" | "not checked"
        self.state = "waiting"
        self.worst: tuple[str, float] = ("", 0.0)
        self.seconds = 0.0
        self._attempts = 0
        self._compiled_forward: Callable[..., Any] = compiled.forward
        compiled.forward = self._forward

    # -- the first forward ---------------------------------------------------------------
    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.state == "fell back":
            return self.eager(*args, **kwargs)
        if self.state != "waiting" or not torch.is_grad_enabled() or not self.plain.training:
            return self._compiled_forward(*args, **kwargs)
        rng = _rng_states(self.plain)
        params = self._params()
        self._before = [None if p.grad is None else p.grad.detach().clone() for _, p in params]
        output = self._compiled_forward(*args, **kwargs)
        if any(not torch.equal(a, b) for a, b in zip(rng, _rng_states(self.plain), strict=True)):
            self._finish("not checked", "its forward draws random numbers (dropout)")
            return output
        self._inputs = (args, kwargs)
        self._synced = bool(getattr(self.eager, "require_backward_grad_sync", True))
        outputs = [t for t in tree_leaves(output) if _differentiable(t)]
        self._output_grads: list[torch.Tensor | None] = [None] * len(outputs)
        for index, tensor in enumerate(outputs):
            tensor.register_hook(self._keeper(index))
        self.state = "pending"
        return output

    def _keeper(self, index: int) -> Callable[[torch.Tensor], None]:
        # A compiled graph that computes the loss itself (Hugging Face's ``labels=``) hands
        # its other outputs' hooks None: no gradient reached them.
        def keep(grad: torch.Tensor | None) -> None:
            self._output_grads[index] = None if grad is None else grad.detach()

        return keep

    def _params(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.plain.named_parameters() if p.requires_grad]

    # -- after the first backward --------------------------------------------------------
    def after_backward(self) -> None:
        """Compare the step's compiled gradients with eager ones (once)."""
        if self.state != "pending":
            return
        start = time.perf_counter()
        params = self._params()
        compiled = [
            _delta(p.grad, before, p) for (_, p), before in zip(params, self._before, strict=True)
        ]
        compiled = self._injected(params, compiled)
        eager = self._eager_grads(params, self.autocast)
        finite = torch.tensor([float(all(bool(torch.isfinite(g).all()) for g in compiled + eager))])
        if self.collective.all_reduce(finite, "min").item() < 1:
            del self._inputs, self._output_grads
            self._attempts += 1
            self.state = "waiting" if self._attempts < _ATTEMPTS else "not checked"
            if self.state == "not checked":
                self._finish("not checked", f"no finite gradients in {_ATTEMPTS} steps")
            return
        names = [name for name, _ in params]
        self.worst = _worst(names, compiled, eager, self.collective)
        name, difference = self.worst
        if difference > self.tolerance and self.precision in ROUNDED:
            reference = self._eager_grads(params, contextlib.nullcontext)
            self.rounding = _rounding(
                names, compiled, eager, reference, self.tolerance, self.collective
            )
        del self._inputs, self._output_grads
        self.seconds = time.perf_counter() - start
        if difference <= self.tolerance or (self.rounding is not None and self.rounding.within):
            self._finish("agreed", "")
            return
        line = (
            f"torch.compile's gradients differ from eager ones on the first step (worst: "
            f"{name}, relative difference {difference:.2g}, tolerance {self.tolerance:g}"
            f"{self._from_float32()})"
        )
        if self.strict:
            raise UserError(f"{line}; --compile strict stops here: drop --compile, or use eager")
        for (_, p), before, grad in zip(params, self._before, eager, strict=True):
            p.grad = grad if before is None else before + grad
        self._finish("fell back", line)

    def _injected(
        self, params: list[tuple[str, nn.Parameter]], compiled: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The compiled gradients as a fault injected here left them (as they were, without
        one), written back into the parameters' gradients."""
        injected = injection.compiled_grads(compiled)
        if injected is compiled:
            return compiled
        pairs = zip(params, self._before, compiled, injected, strict=True)
        for (_, p), before, grad, changed in pairs:
            if changed is not grad:
                p.grad = changed if before is None else before + changed
        return injected

    def _eager_grads(
        self,
        params: list[tuple[str, nn.Parameter]],
        autocast: Callable[[], AbstractContextManager[Any]],
    ) -> list[torch.Tensor]:
        """The eager model's gradients for the kept inputs and output gradients, under
        ``autocast`` (the run's precision, or none for the float32 reference)."""
        args, kwargs = self._inputs
        buffers = [b.detach().clone() for b in self.plain.buffers()]  # BatchNorm's statistics
        with torch.enable_grad(), autocast():
            output = self.plain(*args, **kwargs)
        for buffer, saved in zip(self.plain.buffers(), buffers, strict=True):
            buffer.data.copy_(saved)
        outputs = [t for t in tree_leaves(output) if _differentiable(t)]
        grads_out = [
            torch.zeros_like(o) if g is None else g.to(o.dtype)
            for o, g in zip(outputs, self._output_grads, strict=True)
        ]
        grads = torch.autograd.grad(outputs, [p for _, p in params], grads_out, allow_unused=True)
        eager = [
            torch.zeros_like(p) if g is None else g for (_, p), g in zip(params, grads, strict=True)
        ]
        if self._synced and self.collective.world_size > 1:  # DDP averaged the compiled ones
            flat = self.collective.all_reduce(torch.cat([g.reshape(-1) for g in eager]), "mean")
            eager = [
                part.view_as(g)
                for part, g in zip(flat.split([g.numel() for g in eager]), eager, strict=True)
            ]
        return eager

    def _from_float32(self) -> str:
        if self.rounding is None:
            return ""
        r = self.rounding
        return (
            f"; from float32, {r.name}'s compiled gradients are {r.compiled:.2g} and eager "
            f"{self.precision}'s {r.eager:.2g}"
        )

    def skip(self, reason: str) -> None:
        """No check for this run; one line says why."""
        self._finish("not checked", reason)

    def _finish(self, state: str, line: str) -> None:
        self.state = state
        _, compile_seconds = self.compile_time()
        cost = f"the check took {self.seconds:.2f}s, compiling {compile_seconds:.1f}s"
        if state == "agreed" and self.rounding is not None:
            name, difference = self.worst
            note = (
                f"torch.compile checked: {self.precision} gradients differ from eager by up to "
                f"{difference:.2g} (worst: {name}), no more than {self.precision}'s own rounding"
                f"{self._from_float32()}; {cost}"
            )
        elif state == "agreed":
            name, difference = self.worst
            note = (
                f"torch.compile checked: gradients agree with eager within {difference:.2g} "
                f"(worst: {name}); {cost}"
            )
        elif state == "fell back":
            note = f"{line}: training goes on without compile ({cost})"
        else:
            note = f"torch.compile not checked against eager: {line}"
        self.collective.note(f"paratrain: note: {note}")

    def describe(self) -> dict[str, Any]:
        name, difference = self.worst
        described: dict[str, Any] = {
            "state": self.state,
            "worst_parameter": name,
            "relative_difference": difference,
            "seconds": self.seconds,
        }
        if self.rounding is not None:
            described["from_float32"] = self.rounding._asdict()
        return described


def _rng_states(model: nn.Module) -> list[torch.Tensor]:
    """The generator states a forward of ``model`` may draw from (CPU, its CUDA device)."""
    states = [torch.get_rng_state()]
    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    states += [torch.cuda.get_rng_state(device) for device in devices]
    return states


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _delta(grad: torch.Tensor | None, before: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """What the step's backward added to a parameter's gradient."""
    if grad is None:
        return torch.zeros_like(p)
    return grad.detach() if before is None else grad.detach() - before


def _relative(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    """Per parameter ``|grads - reference| / |reference|`` (the denominator at least 1e-3 of
    the largest parameter's)."""
    norms = torch.stack([g.double().norm() for g in reference])
    floor = max(float(norms.max()) * 1e-3, 1e-12)
    diffs = torch.stack(
        [(a.double() - b.double()).norm() for a, b in zip(grads, reference, strict=True)]
    )
    return diffs / norms.clamp(min=floor)


def _rounding(
    names: list[str],
    compiled: list[torch.Tensor],
    eager: list[torch.Tensor],
    reference: list[torch.Tensor],
    tolerance: float,
    collective: Collective,
) -> Rounding:
    """How far the compiled and eager low-precision gradients are from float32 ones, at the
    parameter where the compiled ones are furthest beyond what eager's rounding allows."""
    from_compiled = _relative(compiled, reference)
    from_eager = _relative(eager, reference)
    allowed = (from_eager * ROUNDING_MARGIN).clamp(min=tolerance)
    excess = from_compiled / allowed
    index = int(excess.argmax())
    largest = collective.all_reduce(excess.max().reshape(1).float(), "max").item()
    return Rounding(
        names[index], float(from_compiled[index]), float(from_eager[index]), largest <= 1
    )


def _worst(
    names: list[str],
    compiled: list[torch.Tensor],
    eager: list[torch.Tensor],
    collective: Collective,
) -> tuple[str, float]:
    """The parameter whose gradients differ most, relatively, and by how much (the largest
    over the processes)."""
    if not names:
        return "", 0.0
    relative = _relative(compiled, eager)
    index = int(relative.argmax())
    largest = collective.all_reduce(relative.max().reshape(1).float(), "max").item()
    return names[index], float(largest)
