"""MTP draft layers against a plain reference of the same equations (dense causal attention).

Tiny random Llama-shaped targets (plain, and Qwen2-style QKV bias with GQA). The predictor runs
over a paged KV cache with shuffled block ids: a whole-sequence pass, the same pass in two
chunks, and chained drafting (depth 2 and 3 as decode rows reading depth 1's cache).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.engine.models.llama import LlamaForCausalLM, ModelConfig, apply_rope
from kvmesh.engine.spec.mtp import SMOLLM2_MTP_HEAD, MultiTokenPredictor

BLOCK = 4


def _config(**kw) -> ModelConfig:
    base = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
    )
    return ModelConfig(**(base | kw))


def _randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp(mtp: MultiTokenPredictor, depth: int, tokens, hidden) -> torch.Tensor:
    """g for rows at positions 0..T-1 of one sequence: the module's equations, written out."""
    c, target = mtp.config, mtp.target
    layer = mtp.layers[(depth - 1) % len(mtp.layers)]
    sd = {k: v.detach() for k, v in layer.state_dict().items()}
    eps, t = c.rms_norm_eps, len(tokens)
    e = target.model.embed_tokens.weight[tokens].clone()
    e[0] = 0.0  # position 0
    x = torch.cat((_rms(e, sd["enorm.weight"], eps), _rms(hidden, sd["hnorm.weight"], eps)), -1)
    x = x @ sd["eh_proj.weight"].T
    b = "mtp_block."
    a = _rms(x, sd[b + "input_layernorm.weight"], eps)
    qkv = a @ sd[b + "self_attn.qkv_proj.weight"].T
    if c.attention_bias:
        qkv = qkv + sd[b + "self_attn.qkv_proj.bias"]
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
    q = q.view(t, c.num_attention_heads, c.head_dim)
    k = k.view(t, c.num_key_value_heads, c.head_dim)
    v = v.view(t, c.num_key_value_heads, c.head_dim)
    freqs = torch.arange(t).float()[:, None] * target.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1)[:, None, :]
    q, k = apply_rope(q, emb.cos(), emb.sin()), apply_rope(k, emb.cos(), emb.sin())
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim**0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, q_size)
    o = o @ sd[b + "self_attn.o_proj.weight"].T
    if c.o_proj_bias:
        o = o + sd[b + "self_attn.o_proj.bias"]
    x = x + o
    m = _rms(x, sd[b + "post_attention_layernorm.weight"], eps)
    gate, up = (m @ sd[b + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
    return x + (F.silu(gate) * up) @ sd[b + "mlp.down_proj.weight"].T


class Paged:
    """One sequence's KV for the MTP layer in shuffled blocks; `table` grows on demand."""

    def __init__(self, c: ModelConfig, num_blocks: int = 24) -> None:
        self.cache = allocate_kv_cache(c, num_blocks, BLOCK, "cpu", torch.float32)[0]
        self.free = list(range(num_blocks))
        random.Random(1).shuffle(self.free)

    def table(self, length: int, table: list[int]) -> list[int]:
        while len(table) * BLOCK < length:
            table.append(self.free.pop())
        return table

    @staticmethod
    def slots(table: list[int], positions: range) -> list[int]:
        return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


@pytest.mark.parametrize("qwen2", [False, True])
@torch.inference_mode()
def test_mtp_matches_reference_whole_chunked_and_chained(qwen2: bool) -> None:
    arch = {"architecture": "Qwen2ForCausalLM", "attention_bias": True} if qwen2 else {}
    c = _config(**arch)
    torch.manual_seed(0)
    target = LlamaForCausalLM(c)
    _randomise(target, 1)
    mtp = MultiTokenPredictor(target, num_layers=2)
    _randomise(mtp, 2)
    n = 11
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, c.vocab_size, (n,), generator=gen)  # t_{i+1} for rows i
    hidden = torch.randn(n, c.hidden_size, generator=gen)  # target's h_i
    want = reference_mtp(mtp, 1, tokens, hidden)

    # whole sequence in one pass
    p = Paged(c)
    table = p.table(n, [])
    meta = AttentionMetadata.build(p.slots(table, range(n)), [n], [n], [table])
    got = mtp(tokens, torch.arange(n), hidden, p.cache, meta, depth=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    logits = mtp.compute_logits(got, depth=1)
    norm_w = mtp.layers[0].shared_head.norm.weight
    ref_logits = _rms(want, norm_w, c.rms_norm_eps) @ target.lm_head.weight.T
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)

    # two chunks (7 then 4) through the cache give the same rows
    p2 = Paged(c)
    t2: list[int] = []
    outs = []
    for lo, hi in ((0, 7), (7, n)):
        p2.table(hi, t2)
        meta = AttentionMetadata.build(p2.slots(t2, range(lo, hi)), [hi - lo], [hi], [t2])
        outs.append(mtp(tokens[lo:hi], torch.arange(lo, hi), hidden[lo:hi], p2.cache, meta))
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-4, atol=1e-4)

    # depth 2 is the second layer: the same pass over its own cache matches its equations
    p3 = Paged(c)
    t3 = p3.table(n, [])
    meta = AttentionMetadata.build(p3.slots(t3, range(n)), [n], [n], [t3])
    got2 = mtp(tokens, torch.arange(n), hidden, p3.cache, meta, depth=2)
    torch.testing.assert_close(got2, reference_mtp(mtp, 2, tokens, hidden), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_mtp_chained_drafts_read_depth_one_cache() -> None:
    """One layer, k = 3: depths 2 and 3 are decode rows at positions n and n + 1 whose inputs
    are the previous depth's draft and g; they attend to depth 1's rows in the same cache."""
    c = _config()
    target = LlamaForCausalLM(c)
    _randomise(target, 6)
    mtp = MultiTokenPredictor(target, num_layers=1)
    _randomise(mtp, 7)
    n = 9
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, c.vocab_size, (n,), generator=gen)
    hidden = torch.randn(n, c.hidden_size, generator=gen)
    p = Paged(c)
    table = p.table(n, [])
    meta = AttentionMetadata.build(p.slots(table, range(n)), [n], [n], [table])
    g = mtp(tokens, torch.arange(n), hidden, p.cache, meta, depth=1)[-1:]
    all_tokens, all_hidden = tokens, hidden
    for depth, pos in ((2, n), (3, n + 1)):
        draft = mtp.compute_logits(g, depth - 1).argmax(-1)
        p.table(pos + 1, table)
        meta = AttentionMetadata.build(p.slots(table, range(pos, pos + 1)), [1], [pos + 1], [table])
        g_new = mtp(draft, torch.tensor([pos]), g, p.cache, meta, depth=depth)
        all_tokens, all_hidden = torch.cat((all_tokens, draft)), torch.cat((all_hidden, g))
        ref = reference_mtp(mtp, depth, all_tokens, all_hidden)
        torch.testing.assert_close(g_new, ref[-1:], rtol=1e-4, atol=1e-4)
        g = g_new


def test_mtp_position_zero_embedding_is_zeroed() -> None:
    c = _config()
    target = LlamaForCausalLM(c)
    _randomise(target, 4)
    mtp = MultiTokenPredictor(target)
    _randomise(mtp, 5)
    p = Paged(c)
    table = p.table(1, [])
    hidden = torch.randn(1, c.hidden_size)
    outs = []
    for tok in (3, 40):
        meta = AttentionMetadata.build(p.slots(table, range(1)), [1], [1], [table])
        outs.append(mtp(torch.tensor([tok]), torch.tensor([0]), hidden, p.cache, meta))
    torch.testing.assert_close(outs[0], outs[1])


def test_mtp_state_dict_holds_only_its_layers_and_bad_input_is_refused() -> None:
    c = _config()
    target = LlamaForCausalLM(c)
    mtp = MultiTokenPredictor(target, num_layers=1)
    names = set(mtp.state_dict())
    assert all(n.startswith("layers.0.") for n in names)
    assert {"layers.0.eh_proj.weight", "layers.0.shared_head.norm.weight"} <= names
    assert mtp.layers[0].eh_proj.weight.shape == (c.hidden_size, 2 * c.hidden_size)
    assert [mtp.layer_for(d) for d in (1, 2, 3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        MultiTokenPredictor(target, num_layers=0)
    with pytest.raises(ValueError, match="hidden_size"):
        MultiTokenPredictor(target, config=_config(hidden_size=16, head_dim=4))
    narrow = MultiTokenPredictor(target, config=_config(intermediate_size=16))
    narrow.init_from_target()  # copies what fits (attention), keeps its own MLP
    torch.testing.assert_close(
        narrow.layers[0].mtp_block.self_attn.qkv_proj.weight,
        target.model.layers[-1].self_attn.qkv_proj.weight,
    )


@torch.inference_mode()
def test_offline_chains_equal_one_chain_at_a_time() -> None:
    """mtp_eval batches every chain of a sequence over a shared block-size-1 cache; each chain
    alone (its own cache, depth 1 over rows 0..i, then decode rows) drafts the same tokens."""
    from kvmesh.engine.spec.mtp_eval import (
        acceptance_per_position,
        chain_drafts,
        greedy_sample,
        target_pass,
    )

    c = _config()
    target = LlamaForCausalLM(c)
    _randomise(target, 9)
    mtp = MultiTokenPredictor(target, num_layers=1)
    _randomise(mtp, 10)
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, c.vocab_size, (14,), generator=gen).tolist()
    sample = target_pass(target, tokens, prompt_len=6)
    k = 3
    starts, drafts = chain_drafts(mtp, sample, k)
    assert starts == list(range(5, 14 - 1 - k))
    for row, i in enumerate(starts):
        p = Paged(c)
        table = p.table(i + 1, [])
        meta = AttentionMetadata.build(p.slots(table, range(i + 1)), [i + 1], [i + 1], [table])
        ids = torch.tensor(tokens[1 : i + 2])
        g = mtp(ids, torch.arange(i + 1), sample.hidden[: i + 1], p.cache, meta)[-1:]
        want = [int(mtp.compute_logits(g, 1).argmax())]
        for depth in range(2, k + 1):
            pos = i + depth - 1
            p.table(pos + 1, table)
            meta = AttentionMetadata.build(p.slots(table, [pos]), [1], [pos + 1], [table])
            g = mtp(torch.tensor(want[-1:]), torch.tensor([pos]), g, p.cache, meta, depth=depth)
            want.append(int(mtp.compute_logits(g, depth).argmax()))
        assert drafts[row].tolist() == want

    incremental = greedy_sample(target, tokens[:6], 4)  # prefill, then one token per pass
    whole = target_pass(target, incremental.tokens, 6)
    torch.testing.assert_close(incremental.hidden, whole.hidden, rtol=1e-4, atol=1e-4)
    assert incremental.argmax.tolist() == whole.argmax.tolist()
    assert incremental.tokens[6:] == whole.argmax[5:-1].tolist()

    acc = acceptance_per_position(mtp, [sample], k)
    assert acc.num_drafts == len(starts)
    ok = drafts == torch.stack([sample.argmax[torch.tensor(starts) + d] for d in (1, 2, 3)], 1)
    assert acc.accepted_per_pos[0] == round(ok[:, 0].float().mean().item(), 4)
    assert acc.accepted_per_pos == sorted(acc.accepted_per_pos, reverse=True)
    assert acc.mean_acceptance_length == round(1 + sum(acc.accepted_per_pos), 4)


def test_head_file_round_trip(tmp_path) -> None:
    from kvmesh.engine.spec.mtp import load_mtp_head, save_mtp_head

    c = _config()
    target = LlamaForCausalLM(c)
    mtp = MultiTokenPredictor(target, config=_config(intermediate_size=24))
    _randomise(mtp, 12)
    path = tmp_path / "head.safetensors"
    assert save_mtp_head(mtp, path, base_model="tiny") == path.stat().st_size
    loaded = load_mtp_head(target, path)
    assert loaded.config.intermediate_size == 24 and loaded.target is target
    for name, value in mtp.state_dict().items():  # stored in bfloat16
        torch.testing.assert_close(loaded.state_dict()[name], value.bfloat16().float())
    other = LlamaForCausalLM(_config(hidden_size=16, head_dim=4))
    with pytest.raises(ValueError, match="hidden_size"):
        load_mtp_head(other, path)


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2_MTP_HEAD.exists(), reason="no trained SmolLM2 head shipped")
def test_shipped_smollm2_head_drafts_the_targets_tokens(smollm2) -> None:
    """The shipped head on a prompt outside its training set: a greedy answer, then every
    answer position drafts 3 tokens; the first must match the target's often."""
    from kvmesh.engine.spec.mtp import load_mtp_head
    from kvmesh.engine.spec.mtp_eval import acceptance_per_position, greedy_sample

    tok, model = smollm2.tokenizer, smollm2.model
    chat = [{"role": "user", "content": "Explain how glaciers shape valleys, step by step."}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    sample = greedy_sample(model, prompt, 49)  # 48 answer positions
    assert len(sample.tokens) == len(prompt) + 48
    acc = acceptance_per_position(load_mtp_head(model, SMOLLM2_MTP_HEAD), [sample], 3)
    assert acc.num_drafts == 48 - 3
    assert acc.accepted_per_pos[0] >= 0.1, acc  # an untrained head scores under 0.01
