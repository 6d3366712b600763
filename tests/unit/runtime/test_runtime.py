"""The Runtime in a user's own loop, with the strategies available on this machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.utils.errors import PlacementError, UserError


def _data(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, 10, generator=generator), torch.randn(n, 1, generator=generator)
    )


def _train(rt: paratrain.Runtime, epochs: int = 2) -> nn.Module:
    model = nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_loader(DataLoader(_data(), batch_size=8, shuffle=True))
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            optimizer.step()
    return model


def test_strategies_lists_the_registry() -> None:
    names = paratrain.strategies()
    assert names[0] == "auto"
    assert {"cpu", "cuda", "mps"} <= set(names)


def test_auto_picks_cpu_without_accelerators() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rt = paratrain.Runtime(seed=0)
    assert rt.device == torch.device("cpu")
    assert (rt.rank, rt.world_size, rt.is_main) == (0, 1, True)
    assert rt.strategy.name in ("cpu", "mps")


def test_setup_returns_what_it_was_given_in_order() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.MSELoss()
    assert rt.setup(model) is model
    out_model, out_opt = rt.setup(model, optimizer)
    assert out_model is model and out_opt is optimizer
    out_model, out_opt, out_loss = rt.setup(model, optimizer, loss_fn)
    assert out_loss is loss_fn
    out_model, out_loss = rt.setup(model, loss_fn=loss_fn)
    assert out_loss is loss_fn


def test_training_through_runtime_learns() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=1)
    model = _train(rt, epochs=20)
    x, y = _data().tensors
    fitted = nn.functional.mse_loss(model(x), y).item()
    baseline = nn.functional.mse_loss(torch.zeros_like(y) + y.mean(), y).item()
    assert fitted < baseline


def test_same_seed_gives_identical_weights() -> None:
    first = _train(paratrain.Runtime(strategy="cpu", seed=3))
    second = _train(paratrain.Runtime(strategy="cpu", seed=3))
    other = _train(paratrain.Runtime(strategy="cpu", seed=4))
    assert torch.equal(first.weight, second.weight)
    assert not torch.equal(first.weight, other.weight)


def test_loader_reshuffles_every_epoch_without_set_epoch() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    dataset = TensorDataset(torch.arange(32))
    loader = rt.setup_loader(DataLoader(dataset, batch_size=32, shuffle=True))
    orders = [next(iter(loader))[0].tolist() for _ in range(3)]
    assert orders[0] != orders[1] != orders[2]
    assert all(sorted(order) == list(range(32)) for order in orders)
    assert loader.epoch == 2


def test_unshuffled_loader_keeps_order_and_all_samples() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    loader = rt.setup_loader(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(loader) == 3


def test_batches_arrive_on_the_runtime_device() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    dataset = TensorDataset(torch.randn(8, 3), torch.arange(8))
    loader = rt.setup_loader(DataLoader(dataset, batch_size=4, collate_fn=_dict_collate))
    batch = next(iter(loader))
    assert set(batch) == {"x", "y"}
    assert batch["x"].device == rt.device


def _dict_collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    xs, ys = zip(*items, strict=True)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}


def test_input_on_another_device_gets_a_clear_error() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    model = rt.setup(nn.Linear(3, 2))
    with pytest.raises(PlacementError, match=r"rt\.setup_loader"):
        model(torch.randn(4, 3, device="meta"))


def test_optimizer_of_another_model_is_refused() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(UserError, match="not the model's"):
        rt.setup(nn.Linear(2, 2), optimizer)


def test_optimizer_created_before_setup_keeps_its_state() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    buffer = optimizer.state[model.weight]["momentum_buffer"].clone()
    model, optimizer = rt.setup(model, optimizer)
    assert torch.equal(optimizer.state[model.weight]["momentum_buffer"], buffer)


def test_backward_rejects_a_non_scalar_loss() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    with pytest.raises(PlacementError, match="scalar"):
        rt.backward(torch.ones(3, requires_grad=True))


def test_print_and_collectives_of_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    rt.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
    tensor = torch.tensor([1.0, 2.0])
    assert rt.all_reduce(tensor) is tensor
    assert rt.all_gather(tensor) == [tensor]
    assert rt.broadcast_object({"a": 1}) == {"a": 1}
    rt.barrier()


def test_launch_runs_the_function_in_this_process() -> None:
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    assert rt.launch(lambda runtime, a, b: (runtime.rank, a + b), 2, 3) == (0, 5)


def test_accumulated_micro_batches_equal_one_big_batch() -> None:
    x, y = _data(16).tensors

    def grads(accumulate: int) -> torch.Tensor:
        rt = paratrain.Runtime(strategy="cpu", seed=0, accumulate=accumulate)
        model = nn.Linear(10, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = rt.setup(model, optimizer)
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
            optimizer.zero_grad()
            with rt.accumulate(model):
                rt.backward(nn.functional.mse_loss(model(xs), ys))
            optimizer.step()
        return model.weight.detach().clone()

    torch.testing.assert_close(grads(1), grads(4), rtol=0, atol=1e-6)


def test_bf16_autocast_on_cpu_returns_float32_outputs() -> None:
    rt = paratrain.Runtime(strategy="cpu", precision="bf16", seed=0)
    seen: list[torch.dtype] = []
    layer = nn.Linear(4, 2)
    layer.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model = rt.setup(nn.Sequential(layer))
    out = model(torch.randn(3, 4))
    assert seen == [torch.bfloat16]
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "nope"}, "valid strategies: auto, cpu"),
        ({"precision": "fp8"}, "valid precisions"),
        ({"strategy": "cpu", "devices": 2}, "--strategy ddp"),
        ({"accumulate": 0}, "accumulate"),
    ],
)
def test_bad_runtime_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message):
        paratrain.Runtime(**kwargs)  # type: ignore[arg-type]


@pytest.mark.cuda
def test_cuda_places_model_optimizer_state_and_batches() -> None:
    rt = paratrain.Runtime(strategy="cuda", devices="1", seed=0)
    model = nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 10)).sum().backward()
    optimizer.step()
    model, optimizer = rt.setup(model, optimizer)
    assert optimizer.state[model.weight]["momentum_buffer"].device.type == "cuda"
    loader = rt.setup_loader(DataLoader(_data(), batch_size=8))
    x, _ = next(iter(loader))
    assert x.device == torch.device("cuda", 0)
    assert loader.loader.pin_memory
    with pytest.raises(PlacementError):
        model(torch.randn(2, 10))
    trained = _train(paratrain.Runtime(strategy="cuda", seed=0))
    assert next(trained.parameters()).is_cuda


class _OwnLoss(nn.Module):
    """A model that computes its own loss from ``labels`` (Hugging Face's idiom)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> object:
        logits = self.fc(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return type("Output", (), {"logits": logits, "loss": loss})()


def test_forward_backward_without_a_loss_function_trains_on_the_models_own_loss() -> None:
    """rt.forward_backward(model, None, x, y): model(x, labels=y).loss and its backward, the
    loop that pipeline's stages run too."""
    torch.manual_seed(0)
    model = _OwnLoss()
    expected = _OwnLoss()
    expected.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 4), torch.randint(3, (8,))
    rt = paratrain.Runtime(strategy="cpu", seed=0)
    model = rt.setup(model)
    loss = rt.forward_backward(model, None, x, y)
    reference = expected(x, labels=y).loss
    reference.backward()
    assert torch.equal(loss, reference)
    assert torch.equal(model.fc.weight.grad, expected.fc.weight.grad)
