"""``--recipe hf:NAME``: a Hugging Face Transformers causal language model, built from its
configuration alone (no weights, no network), trained on tiny-gpt's seeded token language.

``NAME`` is a local ``config.json`` (or a folder holding one, as ``save_pretrained`` writes
it), or a model type Transformers knows (``gpt2``, ``llama``, ...), with that type's default
sizes. The model's own class (``AutoModelForCausalLM``) is trained, so its weights keep
Transformers' names: the run's ``hf/`` folder (its config and the final weights) loads
with ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.training.recipe import Datasets, Params, Recipe, RecipeSettings
from paratrain.utils.errors import UserError

PREFIX = "hf:"
#: tokens per sequence (fewer where the model's context is shorter)
CONTEXT = 64
#: the token language's vocabulary: the first ids of the model's
LANGUAGE_VOCAB = 64
SEQUENCES, TEST_SEQUENCES = 1000, 200


def is_hugging_face(name: str) -> bool:
    return name.startswith(PREFIX)


def hugging_face_recipe(name: str) -> Recipe:
    """The recipe ``hf:NAME``, or ``UserError`` naming what is wrong with ``NAME``."""
    config = load_config(name.removeprefix(PREFIX))
    context = min(CONTEXT, _context_of(config))
    vocab = min(LANGUAGE_VOCAB, int(config.vocab_size))

    def build_model(cfg: RecipeSettings) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config)

    def build_data(cfg: RecipeSettings) -> Datasets:
        from paratrain.data.tokens import markov_tokens

        tokens = markov_tokens(SEQUENCES + TEST_SEQUENCES, context, vocab, seed=7)
        every = range(SEQUENCES + TEST_SEQUENCES)
        return (
            torch.utils.data.Subset(tokens, every[:SEQUENCES]),
            torch.utils.data.Subset(tokens, every[SEQUENCES:]),
        )

    return Recipe(
        name=name,
        description=f"Hugging Face {type(config).__name__} ({config.model_type}) from its "
        "config, on a seeded Markov-chain language",
        epochs=1,
        batch_size=16,
        lr=1e-3,
        build_model=build_model,
        build_data=build_data,
        build_optimizer=_adamw,
        build_loss=_token_loss,
        classification=False,
        hugging_face_config=config.to_dict(),
    )


def load_config(spec: str) -> Any:
    """Transformers' configuration for ``spec``: a config file, a folder, or a model type."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UserError(
            f"--recipe {PREFIX}{spec} needs Hugging Face Transformers: pip install 'paratrain[hf]'"
        ) from None
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return _from_file(path, spec)
    try:
        return AutoConfig.for_model(spec)
    except ValueError:
        raise UserError(
            f"--recipe {PREFIX}{spec}: no config file {spec!r} and no Transformers model type "
            f"of that name; give a config.json (or its folder) or a type such as gpt2 or llama"
        ) from None


def _from_file(path: Path, spec: str) -> Any:
    from transformers import AutoConfig

    try:
        values = json.loads(path.read_text())
        model_type = values.pop("model_type")
        return AutoConfig.for_model(model_type, **values)
    except FileNotFoundError:
        raise UserError(f"--recipe {PREFIX}{spec}: {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"--recipe {PREFIX}{spec}: {path} is not a JSON config") from None
    except (KeyError, AttributeError, TypeError):
        raise UserError(
            f"--recipe {PREFIX}{spec}: {path} names no model_type (a Transformers config.json "
            "has one)"
        ) from None
    except ValueError as error:
        raise UserError(f"--recipe {PREFIX}{spec}: {error}") from None


def _context_of(config: Any) -> int:
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return CONTEXT


def _adamw(params: Params, cfg: RecipeSettings) -> torch.optim.Optimizer:
    assert cfg.lr is not None
    return torch.optim.AdamW(params, lr=cfg.lr)


def _token_loss() -> nn.Module:
    from paratrain.models import TokenCrossEntropy

    return TokenCrossEntropy()
