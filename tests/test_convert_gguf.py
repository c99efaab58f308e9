"""`kvmesh convert-gguf` on the embedded SmolLM2: HF transformers loading the written directory
computes the logits that HF transformers computes from the GGUF itself (its own dequantisation
and Q/K un-permutation) and that the engine computes from the GGUF; the tokenizer and chat
template come through unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.cli import main as kvmesh_main
from kvmesh.engine.models.loader import load_model
from kvmesh.protocol.tokenizer import default_gguf_path, load_gguf_tokenizer
from tests.test_model_hf import PagedLoop

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-hf")
    assert kvmesh_main(["convert-gguf", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    return load_gguf_tokenizer(default_gguf_path())(PROMPT)["input_ids"]


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread: conftest


@torch.inference_mode()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def test_directory_layout(hf_dir) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(hf_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open is not a Mapping)
    assert "model.layers.29.self_attn.q_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert not any("blk." in n for n in names)


def test_tokenizer_and_template_match_gguf(hf_dir, prompt_ids) -> None:
    from transformers import AutoTokenizer

    gguf_tok = load_gguf_tokenizer(default_gguf_path())
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tok(PROMPT)["input_ids"] == prompt_ids
    chat = [{"role": "user", "content": "hi"}]
    rendered = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == gguf_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in rendered


@pytest.fixture(scope="module")
def converted_logits(hf_dir, prompt_ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return _hf_logits(converted, prompt_ids)


def test_transformers_logits_match_engine(converted_logits, prompt_ids) -> None:
    engine = PagedLoop(load_model(None, dtype=torch.float32))
    last = engine.step([(0, prompt_ids)])[0]
    torch.testing.assert_close(converted_logits[-1], last, atol=1e-3, rtol=0)
    # and the weights are a working model, not a consistent mistake of both
    tok = load_gguf_tokenizer(default_gguf_path())
    assert tok.decode([int(converted_logits[-1].argmax())]).strip() == "Rome"


@pytest.mark.slow
def test_transformers_logits_match_transformers_on_gguf(
    hf_dir, converted_logits, prompt_ids
) -> None:
    """Against HF transformers' own GGUF reading, independent of the engine's loader."""
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, config=hf_dir, dtype=torch.float32
    ).eval()
    reference_logits = _hf_logits(reference, prompt_ids)
    torch.testing.assert_close(converted_logits, reference_logits, atol=1e-3, rtol=0)


def test_rejects_non_llama(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    assert kvmesh_main(["convert-gguf", "--out", str(tmp_path / "o"), "--gguf", str(bad)]) != 0
