"""Checks of flags that name files, made before anything loads or starts, so that a wrong path is
the first thing a user reads (not a load-time estimate, nor a traceback from the tokenizer)."""

from __future__ import annotations

from pathlib import Path

from kvmesh.protocol.tokenizer import DEFAULT_MODEL_ALIASES, is_default_model

__all__ = ["DEFAULT_MODEL_ALIASES", "TOKENIZER_FILES", "model_problem"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def model_problem(model: str | None, *, weights: bool) -> str | None:
    """What is wrong with --model `model`, or None. weights: the model's weights will be loaded
    (a real engine); else only its tokenizer (the router, emulated engines)."""
    if is_default_model(model):
        return None
    path = Path(model).expanduser()
    what = "a local Hugging Face model directory, a .gguf file or 'default'"
    if not path.exists():
        return f"--model {model}: no such file or directory (give {what})"
    if path.is_file():
        return None if path.suffix == ".gguf" else f"--model {model}: not a .gguf file"
    if weights and not (path / "config.json").is_file():
        return f"--model {model}: no config.json in this directory (give {what})"
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"--model {model}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in it"
    return None
