"""EAGLE-1 heads and a target's own (DeepSeek-style) MTP layers, loaded from HF directories.

Tiny random Llama targets (hidden 64, 2 layers, vocab 97) are written as HF directories with
safetensors, one of them with MTP layers at model.layers.{2 + i}; an EAGLE-1 head is written as
its authors publish it (config.json + fc + layers.0, no input_layernorm). Checked against a
plain-torch reference of the equations written here over the raw checkpoint tensors (dense
causal attention, no paging): the loaded drafters' logits, and in the real engine (paged KV,
block size 4, chunked prefill) every chained draft; greedy output with speculation equals the
output without it. Bad heads and configs are refused with their reason.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.builder import assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.models.loader import load_model
from kvmesh.engine.models.moe import MoeConfig
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.target_mtp import check_supported
from kvmesh.engine.torch_runner import TorchRunner

from .test_spec_mtp_engine import ACCEPTED, counters

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 97, 64, 96, 2, 4, 2, 16
EPS, THETA, K = 1e-5, 10000.0, 3
DRAFTS = 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"}'
Weights = dict[str, torch.Tensor]


# --- checkpoints ------------------------------------------------------------------------------


def _layer(gen: torch.Generator, prefix: str, hidden: int = HIDDEN, norm: bool = True) -> Weights:
    def w(*dims: int) -> torch.Tensor:
        return torch.randn(dims, generator=gen) * dims[-1] ** -0.5

    out = {
        prefix + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        prefix + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, hidden),
        prefix + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, hidden),
        prefix + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, hidden),
        prefix + "self_attn.o_proj.weight": w(hidden, HEADS * HEAD_DIM),
        prefix + "mlp.gate_proj.weight": w(INTER, hidden),
        prefix + "mlp.up_proj.weight": w(INTER, hidden),
        prefix + "mlp.down_proj.weight": w(hidden, INTER),
    }
    if norm:
        out[prefix + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    return out


def _config(**extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    } | extra


def save_target(path, tokenizer, seed: int, mtp_layers: int = 0, bigram: bool = False) -> Weights:
    """A random Llama HF directory; with mtp_layers, DeepSeek-named MTP layers after its own:
    layer 0 stores copies of the target's embedding and head, layer 1 a head of its own."""
    gen = torch.Generator().manual_seed(seed)
    t: Weights = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen),
        "model.norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * HIDDEN**-0.5 * 4,
    }
    for i in range(LAYERS):
        t |= _layer(gen, f"model.layers.{i}.")
    for i in range(mtp_layers):
        p = f"model.layers.{LAYERS + i}."
        t |= _layer(gen, p)
        t[p + "enorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
        t[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
        t[p + "eh_proj.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * HIDDEN**-0.5
        t[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
        if i == 0:
            t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
            t[p + "shared_head.head.weight"] = t["lm_head.weight"].clone()
        else:
            t[p + "shared_head.head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    if bigram:
        _bigram(t)
    path.mkdir()
    save_file(t, str(path / "model.safetensors"))
    config = _config(num_nextn_predict_layers=mtp_layers) if mtp_layers else _config()
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    return t


def save_eagle(path, seed: int, hidden: int = HIDDEN, bigram: bool = False) -> Weights:
    """An EAGLE-1 head directory as its authors publish one (no layers.0.input_layernorm)."""
    gen = torch.Generator().manual_seed(seed)
    t = _layer(gen, "layers.0.", hidden, norm=False)
    t["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5
    t["fc.bias"] = 0.1 * torch.randn(hidden, generator=gen)
    if bigram:
        _bigram(t)
    t["embed_tokens.weight"] = torch.zeros(VOCAB, hidden)  # a stored copy: never read
    path.mkdir()
    save_file(t, str(path / "model.safetensors"))
    config = _config(hidden_size=hidden, num_hidden_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return t


def _bigram(t: Weights) -> None:
    """Turn a target into a bigram model (its next token a function of the current one: every
    residual branch zero, a plain final norm), and a head for it into one that knows that
    function: it passes the embedding through and its own branches are zero too."""
    for name, w in t.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "fc.bias")):
            w.zero_()
        elif name.endswith(("model.norm.weight", "enorm.weight", "shared_head.norm.weight")):
            w.fill_(1.0)
        elif name.endswith(("eh_proj.weight", "fc.weight")):  # [embedding ; hidden] -> embedding
            w.zero_()
            w[:, : w.shape[0]] = torch.eye(w.shape[0])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("heads")
    plain = save_target(root / "target", tokenizer, seed=1)
    mtp2 = save_target(root / "target_mtp", tokenizer, seed=2, mtp_layers=2)
    mtp1 = save_target(root / "target_mtp1", tokenizer, seed=4, mtp_layers=1)
    eagle = save_eagle(root / "eagle", seed=3)
    save_target(root / "bigram", tokenizer, seed=5, mtp_layers=1, bigram=True)
    save_eagle(root / "eagle_bigram", seed=6, bigram=True)
    return root, {"target": plain, "target_mtp": mtp2, "target_mtp1": mtp1, "eagle": eagle}


# --- the reference: the equations over raw HF tensors -----------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE at positions 0..T-1: x [T, heads, head_dim]."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    f = torch.arange(len(x)).float()[:, None] * inv[None, :]
    angle = torch.cat((f, f), -1)[:, None, :]
    x1, x2 = x.chunk(2, -1)
    return x * angle.cos() + torch.cat((-x2, x1), -1) * angle.sin()


def _decoder(w: Weights, p: str, x: torch.Tensor, input_norm: bool = True) -> torch.Tensor:
    """One Llama decoder layer over rows 0..T-1 of one sequence, dense causal attention."""
    n = len(x)
    a = _rms(x, w[p + "input_layernorm.weight"]) if input_norm else x
    q = _rope((a @ w[p + "self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM))
    k = _rope((a @ w[p + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM))
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HEAD_DIM)
    x = x + o @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(x, w[p + "post_attention_layernorm.weight"])
    up = F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
    return x + up @ w[p + "mlp.down_proj.weight"].T


def ref_target(w: Weights, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden state (after its norm) at every position."""
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(LAYERS):
        x = _decoder(w, f"model.layers.{i}.", x)
    return _rms(x, w["model.norm.weight"])


def ref_eagle(head: Weights, target: Weights, tokens, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, logits) of an EAGLE-1 head for rows (tokens[i], hidden[i]) at positions 0..T-1:
    fc over [embedding ; hidden], the layer without its input norm, the target's head."""
    x = torch.cat((target["model.embed_tokens.weight"][tokens], hidden), -1)
    x = x @ head["fc.weight"].T + head.get("fc.bias", torch.zeros(HIDDEN))
    g = _decoder(head, "layers.0.", x, input_norm=False)
    return g, g @ target["lm_head.weight"].T


def ref_mtp(w: Weights, layer: int, tokens, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, logits) of DeepSeek-V3 MTP layer `layer` (0-based) for rows at positions 0..T-1:
    [enorm(embedding, zero at position 0) ; hnorm(hidden)] -> eh_proj -> decoder layer ->
    shared_head.norm -> shared_head.head."""
    p = f"model.layers.{LAYERS + layer}."
    e = w["model.embed_tokens.weight"][tokens].clone()
    e[0] = 0.0
    x = torch.cat((_rms(e, w[p + "enorm.weight"]), _rms(hidden, w[p + "hnorm.weight"])), -1)
    g = _decoder(w, p, x @ w[p + "eh_proj.weight"].T)
    return g, _rms(g, w[p + "shared_head.norm.weight"]) @ w[p + "shared_head.head.weight"].T


def ref_drafts(step, target: Weights, tokens: list[int], k: int) -> list[int]:
    """k chained drafts after `tokens` (the verified ones and the newest), recomputed densely:
    depth 1 reads (t_{i+1}, h_i) for every position, depth d > 1 appends the row
    (draft d - 1, g of depth d - 1) and reruns the layer over the whole sequence of rows."""
    n = len(tokens) - 1
    ids, hidden = list(tokens[1:]), ref_target(target, tokens[:n])
    drafts: list[int] = []
    for _ in range(k):
        g, logits = step(ids, hidden)
        drafts.append(int(logits[-1].argmax()))
        ids, hidden = ids + drafts[-1:], torch.cat((hidden, g[-1:]))
    return drafts


# --- (a) the loaded drafters' equations ---------------------------------------------------------


def _drafter(root, spec: dict):
    loaded = load_model(str(root / spec.pop("target")))
    runner = TorchRunner(EngineConfig(block_size=4, num_gpu_blocks=16), loaded)
    config = SpeculativeConfig.from_dict(spec)
    config.resolve(loaded.config.num_nextn_predict_layers)
    return runner.proposer(config).mtp


@torch.inference_mode()
def _run_layer(drafter, ids: list[int], hidden: torch.Tensor, depth: int) -> torch.Tensor:
    """Logits of the drafter's layer for `depth` over rows at positions 0..T-1 (one block of
    size 1 per row, a fresh cache)."""
    n = len(ids)
    cache = allocate_kv_cache(drafter.config, n, 1, "cpu", torch.float32)[0]
    meta = AttentionMetadata.build(list(range(n)), [n], [n], [list(range(n))])
    g = drafter(torch.tensor(ids), torch.arange(n), hidden, cache, meta, depth=depth)
    return drafter.compute_logits(g, depth)


def test_eagle_head_logits_equal_reference(dirs, one_thread) -> None:
    root, w = dirs
    spec = {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 2}
    drafter = _drafter(root, spec | {"target": "target"})
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(VOCAB, (11,), generator=gen).tolist()
    hidden = torch.randn(11, HIDDEN, generator=gen)
    _, want = ref_eagle(w["eagle"], w["target"], ids, hidden)
    for depth in (1, 2):  # one layer serves every depth
        got = _run_layer(drafter, ids, hidden, depth)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_target_mtp_layers_logits_equal_reference(dirs, one_thread) -> None:
    root, w = dirs
    spec = {"method": "mtp", "num_speculative_tokens": 4}  # two layers, round-robin
    drafter = _drafter(root, spec | {"target": "target_mtp"})
    assert len(drafter.layers) == 2
    assert drafter.embed_tokens is None  # the stored copy equals the target's: shared
    assert drafter.layers[0].shared_head.head is None
    assert drafter.layers[1].shared_head.head is not None  # its own, differing head
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(VOCAB, (11,), generator=gen).tolist()
    hidden = torch.randn(11, HIDDEN, generator=gen)
    for depth in (1, 2, 3):
        _, want = ref_mtp(w["target_mtp"], (depth - 1) % 2, ids, hidden)
        got = _run_layer(drafter, ids, hidden, depth)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- (b) in the engine: chained drafts and greedy output --------------------------------------


def _run(root, name: str, prompts, spec: dict | None = None, **cfg):
    loaded = load_model(str(root / name))
    if spec is not None:
        cfg["speculative_config"] = json.dumps(spec)
    config = EngineConfig(**{"block_size": 4, "num_gpu_blocks": 64, **cfg})
    bundle = assemble(config, TorchRunner(config, loaded), loaded.tokenizer, "m", "p", ())
    core = bundle.engine.core
    proposed = []  # (tokens, limit, drafts) of each request past its prefill, at each propose
    if core.speculator is not None:
        proposer = core.speculator.proposer
        inner = proposer.propose

        def spy(requests, limits):
            out = inner(requests, limits)
            for r, limit, d in zip(requests, limits, out, strict=True):
                if len(r.all_token_ids) == r.num_computed_tokens + 1:
                    proposed.append((list(r.all_token_ids), limit, list(d)))
            return out

        proposer.propose = spy
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reqs = [Request(str(i), p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    for _ in range(1000):
        if not core.has_work():
            break
        core.step()
    bundle.publisher.close()
    return [r.output_token_ids for r in reqs], proposed, counters(bundle)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 11, 3)]


@pytest.mark.parametrize("cfg", [{}, {"max_num_batched_tokens": 7}], ids=["batched", "chunked"])
@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_greedy_with_drafts_equals_plain(dirs, one_thread, method: str, cfg: dict) -> None:
    """Output equals decoding without drafts, and every chained draft equals the reference's
    (a one-layer head: depth 1 overwrites each chain row before a later row reads it)."""
    root, w = dirs
    if method == "eagle":
        name, target = "target", w["target"]
        spec = {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": K}

        def step(ids, hidden):
            return ref_eagle(w["eagle"], target, ids, hidden)
    else:
        name, target = "target_mtp1", w["target_mtp1"]
        spec = {"method": "mtp", "num_speculative_tokens": K}  # the one layer, reapplied

        def step(ids, hidden):
            return ref_mtp(target, 0, ids, hidden)

    plain, _, _ = _run(root, name, _prompts(), **cfg)
    outputs, proposed, values = _run(root, name, _prompts(), spec, **cfg)
    assert outputs == plain
    assert values[DRAFTS] > 20 and len(proposed) > 10
    for tokens, limit, drafts in proposed:
        assert len(drafts) == min(limit, K)  # the lookahead slots are always there
        assert drafts == ref_drafts(step, target, tokens, len(drafts)), tokens


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_head_that_knows_the_target_gets_every_draft_accepted(dirs, one_thread, method) -> None:
    """A bigram target and a head computing its bigram: every chained draft is right, so
    several tokens are accepted per step through the rollback and depth-1 overwrite paths."""
    root, _ = dirs
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "eagle":
        spec["model"] = str(root / "eagle_bigram")
    plain, _, _ = _run(root, "bigram", _prompts(), max_num_batched_tokens=7)
    outputs, proposed, values = _run(root, "bigram", _prompts(), spec, max_num_batched_tokens=7)
    assert outputs == plain
    assert values[DRAFTS] > 20
    assert values[ACCEPTED] == values[DRAFTS]


# --- (c) refusals -----------------------------------------------------------------------------


def test_bad_heads_and_configs_are_refused(dirs, tmp_path, one_thread) -> None:
    root, _ = dirs
    with pytest.raises(ValueError, match="model is required for method 'eagle'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    save_eagle(tmp_path / "wide", seed=5, hidden=2 * HIDDEN)
    spec = {"method": "eagle", "model": str(tmp_path / "wide"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="hidden_size 128 .*the target 64"):
        _drafter(root, spec | {"target": "target"})
    with pytest.raises(ValueError, match="not a directory with a config.json"):
        _drafter(root, spec | {"target": "target", "model": str(tmp_path / "missing")})
    spec3 = spec | {"method": "eagle3", "model": str(root / "eagle")}
    with pytest.raises(ValueError, match="'eagle3' is not supported yet"):
        _drafter(root, spec3 | {"target": "target"})
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1"):  # the builder's path
        _drafter(root, {"method": "mtp", "num_speculative_tokens": 2, "target": "target"})
    loaded = load_model(str(root / "target"))
    runner = TorchRunner(EngineConfig(block_size=4, num_gpu_blocks=16), loaded)
    config = SpeculativeConfig(method="mtp", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="carries no MTP layers"):  # the runner's own check
        runner.proposer(config)
    spec_json = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    config = EngineConfig(block_size=4, num_gpu_blocks=16, speculative_config=spec_json)
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1"):
        assemble(config, TorchRunner(config, loaded), loaded.tokenizer, "m", "p", ())
    mtp = load_model(str(root / "target_mtp1"))  # not from an HF directory: nowhere to read
    elsewhere = SimpleNamespace(model=mtp.model, config=mtp.config)
    runner = TorchRunner(EngineConfig(block_size=4, num_gpu_blocks=16), elsewhere)
    with pytest.raises(ValueError, match="load from its HF directory"):
        runner.proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=1))
    moe = MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    )
    arch = "Qwen3MoeForCausalLM"
    config = replace(mtp.config, architecture=arch, moe=moe, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=rf"MTP layer \[2\] of this {arch} is a sparse-MoE layer;"):
        check_supported(config)
