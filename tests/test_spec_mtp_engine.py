"""MTP drafting in the engine (MtpProposer on TorchRunner).

A tiny random Llama target with a random MTP head runs in the real engine (paged KV, block
size 4, chunked prefill, preemption); every draft it proposes equals a recompute of the MTP
equations over the whole sequence without paging. On SmolLM2 with its shipped head, greedy
output is the output without speculation, token for token, and drafts get accepted.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.builder import assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.models.llama import LlamaForCausalLM, ModelConfig
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.engine.spec.config import SpeculativeConfig
from kvmesh.engine.spec.mtp import MultiTokenPredictor, save_mtp_head
from kvmesh.engine.spec.mtp_eval import target_pass
from kvmesh.engine.torch_runner import TorchRunner

CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
EDIT = f"Rename width to w in this file and return the whole file.\n\n{CODE}\n"
PROMPTS = [EDIT, "The capital of France is", f"Copy this text exactly:\n{CODE}\nCopy:\n"]
K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K, "model": "smollm2"}
ACCEPTED = 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"}'


def _tiny(seed: int) -> tuple[LlamaForCausalLM, MultiTokenPredictor]:
    c = ModelConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
    )
    target = LlamaForCausalLM(c).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    mtp = MultiTokenPredictor(target)
    mtp.init_from_target()  # drafts close to the target's own next token: some get accepted
    with torch.no_grad():
        for p in mtp.parameters():
            if p.ndim > 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return target, mtp


@torch.inference_mode()
def reference_drafts(mtp: MultiTokenPredictor, tokens: list[int], k: int) -> list[int]:
    """Drafts after `tokens` (verified tokens and the newest one), recomputed from scratch:
    the target over tokens[:-1], depth 1 over every row, then k - 1 chained decode rows, in a
    block-size-1 cache with the rows in order."""
    n = len(tokens) - 1
    hidden = target_pass(mtp.target, tokens[:n], 0).hidden
    cache = allocate_kv_cache(mtp.config, n + k, 1, "cpu", torch.float32)[0]
    meta = AttentionMetadata.build(list(range(n)), [n], [n], [list(range(n))])
    g = mtp(torch.tensor(tokens[1:]), torch.arange(n), hidden, cache, meta)[-1:]
    drafts = [int(mtp.compute_logits(g, 1).argmax())]
    for depth in range(2, k + 1):
        pos = n + depth - 2
        table = list(range(pos + 1))
        meta = AttentionMetadata.build([pos], [1], [pos + 1], [table])
        g = mtp(torch.tensor(drafts[-1:]), torch.tensor([pos]), g, cache, meta, depth=depth)
        drafts.append(int(mtp.compute_logits(g, depth).argmax()))
    return drafts


def _run_tiny(tokenizer, target, prompts, spec=None, **cfg):
    loaded = SimpleNamespace(model=target, config=target.config)
    if spec is not None:
        cfg["speculative_config"] = json.dumps(spec)
    config = EngineConfig(**{"block_size": 4, "num_gpu_blocks": 64, **cfg})
    bundle = assemble(config, TorchRunner(config, loaded), tokenizer, "m", "p", ())
    core = bundle.engine.core
    proposed = []  # (tokens, limit, drafts) of every request at every propose()
    if core.speculator is not None:
        proposer = core.speculator.proposer
        inner = proposer.propose

        def spy(requests, limits):
            out = inner(requests, limits)
            for r, limit, d in zip(requests, limits, out, strict=True):
                if len(r.all_token_ids) == r.num_computed_tokens + 1:
                    proposed.append((list(r.all_token_ids), limit, list(d)))
                else:  # still prefilling: nothing to draft from
                    assert d == []
            return out

        proposer.propose = spy
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = [Request(str(i), p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    for _ in range(2000):
        if not core.has_work():
            break
        core.step()
    bundle.publisher.close()
    return reqs, proposed, bundle


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefill across block boundaries
        {"num_gpu_blocks": 14, "max_num_batched_tokens": 64},  # preemption and recompute
    ],
    ids=["batched", "chunked", "preempting"],
)
def test_paged_drafts_equal_unpaged_reference(tmp_path, tokenizer, one_thread, cfg):
    target, mtp = _tiny(seed=3)
    head = tmp_path / "head.safetensors"
    save_mtp_head(mtp, head, base_model="tiny")
    from kvmesh.engine.spec.mtp import load_mtp_head

    ref_mtp = load_mtp_head(target, head)  # bfloat16 on disk: compare with what loads
    rng = random.Random(2)
    prompts = [[rng.randrange(61) for _ in range(n)] for n in (5, 10, 14, 3)]
    spec = {"method": "mtp", "num_speculative_tokens": K, "model": str(head)}
    plain, _, _ = _run_tiny(tokenizer, target, prompts, **cfg)
    reqs, proposed, bundle = _run_tiny(tokenizer, target, prompts, spec, **cfg)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in plain]
    assert len(proposed) > 20
    for tokens, limit, drafts in proposed:
        assert len(drafts) == min(limit, K)  # the lookahead slots are always there
        assert drafts == reference_drafts(ref_mtp, tokens, len(drafts)), tokens
    assert counters(bundle)[ACCEPTED] > 0  # accepted drafts' rows go through depth 1 too
    if "num_gpu_blocks" in cfg:
        assert bundle.engine.core.scheduler.num_preemptions > 0


def test_bad_heads_are_refused_with_their_reason(tmp_path, tokenizer, one_thread):
    target, _ = _tiny(seed=5)
    loaded = SimpleNamespace(model=target, config=target.config)
    runner = TorchRunner(EngineConfig(block_size=4, num_gpu_blocks=8), loaded)

    def proposer(model):
        return runner.proposer(
            SpeculativeConfig(method="mtp", num_speculative_tokens=2, model=model)
        )

    with pytest.raises(ValueError, match="no such file"):
        proposer(str(tmp_path / "missing.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="does not fit the target"):
        proposer(str(tmp_path / "junk.safetensors"))
    with pytest.raises(ValueError, match="hidden_size"):  # the SmolLM2 head on a tiny target
        proposer("smollm2")
    with pytest.raises(ValueError, match='carries no MTP layers.*"model": "smollm2"'):
        proposer(None)
    other, _ = _tiny(seed=6)  # a head for another target of the same shape loads and drafts
    save_mtp_head(MultiTokenPredictor(other), tmp_path / "ok.safetensors", base_model="tiny")
    assert proposer(str(tmp_path / "ok.safetensors")).num_lookahead_tokens == 1
    config = EngineConfig(  # through the engine's own path: the builder
        block_size=4,
        num_gpu_blocks=8,
        speculative_config=json.dumps({"method": "mtp", "model": str(tmp_path / "nope")}),
    )
    with pytest.raises(ValueError, match="no such file"):
        assemble(config, TorchRunner(config, loaded), tokenizer, "m", "p", ())


def run(smollm2, prompts, spec=None, max_tokens=40, **cfg):
    if spec is not None:
        cfg["speculative_config"] = json.dumps(spec)
    config = EngineConfig(**{"num_gpu_blocks": 256, **cfg})
    bundle = assemble(config, TorchRunner(config, smollm2), smollm2.tokenizer, "m", "p", ())
    core = bundle.engine.core
    reqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        reqs.append(Request(str(i), smollm2.tokenizer.encode(p), params, eos_token_ids=(2,)))
        core.add_request(reqs[-1])
    texts = {r.request_id: "" for r in reqs}
    for _ in range(3000):
        if not core.has_work():
            break
        for out in core.step():
            texts[out.request_id] += out.text
    bundle.publisher.close()
    return reqs, texts, bundle


def counters(bundle) -> dict[str, float]:
    page = generate_latest(bundle.metrics.registry).decode()
    values = {}
    for line in page.splitlines():
        if line.startswith("vllm:spec_decode") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _greedy_equals_plain(smollm2, max_tokens=40, **cfg) -> tuple[int, int]:
    plain, plain_text, plain_bundle = run(smollm2, PROMPTS, max_tokens=max_tokens, **cfg)
    spec, spec_text, bundle = run(smollm2, PROMPTS, MTP, max_tokens=max_tokens, **cfg)
    for a, b in zip(plain, spec, strict=True):
        assert b.output_token_ids == a.output_token_ids
        assert b.status == a.status
    assert spec_text == plain_text
    assert counters(bundle)[ACCEPTED] > 0
    return plain_bundle.engine.core.num_steps, bundle.engine.core.num_steps


def test_smollm2_mtp_greedy_equals_plain(smollm2, one_thread):
    plain_steps, spec_steps = _greedy_equals_plain(smollm2, max_tokens=24)
    assert spec_steps < plain_steps  # some steps emit several tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    "cfg",
    [
        {"max_num_batched_tokens": 7},  # chunked prefill; drafts trimmed to the budget
        {"num_gpu_blocks": 24, "block_size": 4, "max_num_batched_tokens": 64},  # preemption
    ],
    ids=["chunked", "preempting"],
)
def test_smollm2_mtp_greedy_equals_plain_chunked_and_preempting(smollm2, one_thread, cfg):
    _greedy_equals_plain(smollm2, **cfg)
