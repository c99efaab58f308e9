"""Draft-model speculation in the engine (DraftModelProposer on TorchRunner).

Tiny random Llama checkpoints (HF directories, loaded the way the engine loads a draft) run in
the real engine (paged KV, block size 4, chunked prefill, preemption): greedy output equals the
output without speculation, and every draft equals a dense recompute of the draft model over
the request's tokens. A draft identical to the target gets every draft accepted.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.builder import assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.models.loader import load_model
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.torch_runner import TorchRunner

from .test_spec_mtp_engine import ACCEPTED, _run_tiny, counters

K = 3
DRAFTS = 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"}'
TARGET = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "kv_heads": 2}
DRAFT = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "kv_heads": 1}


def save_tiny(path, tokenizer, seed: int, vocab: int = 61, **shape) -> str:
    """A random Llama as an HF directory (config.json, safetensors, tokenizer files)."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv_heads, head_dim, inter = shape["num_attention_heads"], shape["kv_heads"], 8, 48
    gen = torch.Generator().manual_seed(seed)

    def w(*dims: int) -> torch.Tensor:
        if len(dims) == 1:
            return 1.0 + 0.3 * torch.randn(dims, generator=gen)
        return 0.3 * torch.randn(dims, generator=gen)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden)}
    tensors["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": w(hidden),
            p + "post_attention_layernorm.weight": w(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    return str(path)


@torch.inference_mode()
def reference_drafts(draft, tokens: list[int], n: int) -> list[int]:
    """n greedy drafts after `tokens`, each from a fresh dense pass of the draft model over the
    tokens and the drafts so far (one block holding the whole sequence)."""
    seq = list(tokens)
    for _ in range(n):
        t = len(seq)
        cache = allocate_kv_cache(draft.config, 1, t, "cpu", torch.float32)
        meta = AttentionMetadata.build(list(range(t)), [t], [t], [[0]])
        hidden = draft(torch.tensor(seq), torch.arange(t), cache, meta)
        seq.append(int(draft.compute_logits(hidden[-1:]).argmax()))
    return seq[len(tokens) :]


def _prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(61) for _ in range(n)] for n in (5, 10, 14, 3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("draft_model")
    target = save_tiny(root / "target", tokenizer, seed=3, **TARGET)
    draft = save_tiny(root / "draft", tokenizer, seed=4, **DRAFT)
    return target, draft


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefill across block boundaries
        {"num_gpu_blocks": 14, "max_num_batched_tokens": 64},  # preemption and recompute
        {"draft_max_model_len": 21},  # the draft's own limit: no drafts past position 20
    ],
    ids=["batched", "chunked", "preempting", "draft_max_len"],
)
def test_paged_drafts_equal_dense_reference(models, tokenizer, one_thread, cfg):
    cfg = dict(cfg)
    draft_len = cfg.pop("draft_max_model_len", None)
    target = load_model(models[0]).model
    draft = load_model(models[1]).model
    spec = {"method": "draft_model", "num_speculative_tokens": K, "model": models[1]}
    if draft_len is not None:
        spec["max_model_len"] = draft_len
    plain, _, _ = _run_tiny(tokenizer, target, _prompts(), **cfg)
    reqs, proposed, bundle = _run_tiny(tokenizer, target, _prompts(), spec, **cfg)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    assert len(proposed) > 20
    for tokens, limit, drafts in proposed:
        # the newest token sits at len - 1, draft d at len - 1 + d: all below the draft's limit
        room = (draft_len or 256) - len(tokens) + 1
        assert len(drafts) == max(0, min(limit, K, room))  # lookahead slots always there
        assert drafts == reference_drafts(draft, tokens, len(drafts)), tokens
    if draft_len is not None:
        assert any(not d for _, _, d in proposed)
    if "num_gpu_blocks" in cfg:
        assert bundle.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 7}], ids=["batched", "chunked"])
def test_draft_equal_to_target_gets_every_draft_accepted(models, tokenizer, one_thread, cfg):
    target = load_model(models[0]).model
    spec = {"method": "draft_model", "num_speculative_tokens": K, "model": models[0]}
    plain, _, plain_bundle = _run_tiny(tokenizer, target, _prompts(), **cfg)
    reqs, proposed, bundle = _run_tiny(tokenizer, target, _prompts(), spec, **cfg)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    values = counters(bundle)
    assert values[DRAFTS] > 20
    assert values[ACCEPTED] == values[DRAFTS]
    assert bundle.engine.core.num_steps < plain_bundle.engine.core.num_steps


def test_bad_drafts_are_refused_with_their_reason(models, tmp_path, tokenizer, one_thread):
    loaded = load_model(models[0])
    runner = TorchRunner(EngineConfig(block_size=4, num_gpu_blocks=8), loaded)

    def proposer(model):
        return runner.proposer(
            SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model=model)
        )

    with pytest.raises(ValueError, match="does not load.*neither"):
        proposer(str(tmp_path / "missing"))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="does not load"):
        proposer(str(junk))
    other = save_tiny(tmp_path / "other", tokenizer, seed=5, vocab=67, **DRAFT)
    with pytest.raises(ValueError, match="vocab_size 67, the target 61"):
        proposer(other)
    ok = proposer(models[1])
    assert ok.num_lookahead_tokens == 2
    assert len(ok.kv_caches) == 1 and ok.kv_caches[0].shape[1] == runner.num_blocks
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": other}
    config = EngineConfig(block_size=4, num_gpu_blocks=8, speculative_config=json.dumps(spec))
    with pytest.raises(ValueError, match="vocab_size"):  # through the engine's own path
        assemble(config, TorchRunner(config, loaded), tokenizer, "m", "p", ())


@pytest.mark.slow
def test_smollm2_drafting_for_itself_accepts_everything(smollm2):
    from .test_spec_mtp_engine import PROMPTS, run

    spec = {"method": "draft_model", "num_speculative_tokens": K, "model": "smollm2"}
    plain, plain_text, _ = run(smollm2, PROMPTS[1:], max_tokens=16)
    reqs, text, bundle = run(smollm2, PROMPTS[1:], spec, max_tokens=16)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    assert text == plain_text
    values = counters(bundle)
    assert values[ACCEPTED] == values[DRAFTS] > 0
