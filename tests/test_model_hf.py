"""Our paged decoder against HF transformers: greedy tokens and logits must match.

Tiny random Llama / Qwen2 (QKV bias) / Qwen3 (q/k norm) checkpoints saved with save_pretrained,
and SmolLM2 from the embedded GGUF (HF dequantises it independently). Each runs through a small
stand-in for the engine's runner: whole-prompt prefill, a 2-chunk prefill, and a mixed batch
(one sequence decoding while two prefill) followed by batched decode of three sequences.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvmesh.engine.attention import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from kvmesh.engine.models.loader import load_model
from kvmesh.engine.tokenizer import default_gguf_path, load_gguf_tokenizer

NEW_TOKENS = 16
BLOCK_SIZE = 16
PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention and key-value caches, please.",
    "1, 2, 3,",
]


class PagedLoop:
    """The runner's job in miniature: per-sequence block tables (shuffled block ids) and steps."""

    def __init__(self, loaded, num_blocks: int = 48) -> None:
        self.model = loaded.model
        self.caches = allocate_kv_cache(loaded.config, num_blocks, BLOCK_SIZE, "cpu", torch.float32)
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One step over (seq, new tokens) chunks -> logits [num_seqs, vocab] of each last token."""
        ids, pos, slots, qlens, ctxs, tables, rows = [], [], [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.free.pop())
            ids += tokens
            pos += range(start, start + len(tokens))
            slots += [
                table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos[-len(tokens) :]
            ]
            qlens.append(len(tokens))
            ctxs.append(start + len(tokens))
            tables.append(table)
            rows.append(len(ids) - 1)
            self.lens[seq] = start + len(tokens)
        meta = AttentionMetadata.build(slots, qlens, ctxs, tables)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
        return self.model.compute_logits(hidden[rows])


def hf_greedy(hf, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    out = hf.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,  # generate all NEW_TOKENS, past any end-of-turn token
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat(out.logits).float()


class Case:
    def __init__(self, loaded, hf) -> None:
        self.loaded, self.hf = loaded, hf
        self.prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS]
        self.refs = [hf_greedy(hf, p) for p in self.prompts]

    def check(self, i: int, tokens: list[int], logits: list[torch.Tensor]) -> None:
        ref_tokens, ref_logits = self.refs[i]
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.stack(logits), ref_logits, atol=1e-3, rtol=0)


def _perturb(hf) -> None:
    """Randomise every parameter (biases and norm weights start at 0 / 1) so each one matters."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2, generator=gen)


pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread: conftest


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_gguf_tokenizer(default_gguf_path())


def _tiny_case(arch: str, tmp_path_factory, tokenizer) -> Case:
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config = getattr(transformers, f"{cls}Config")(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32 if arch == "qwen3" else 16,
        tie_word_embeddings=arch == "qwen2",
        rope_theta=1000.0,
        max_position_embeddings=256,
    )
    if arch == "llama":  # Llama-3 scaling with all three wavelength bands in play
        config.rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": 1000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    torch.manual_seed(0)
    hf = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    _perturb(hf)
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Case(load_model(str(path)), hf)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "smollm2"])
def case(request, tmp_path_factory, smol_tokenizer) -> Case:
    if request.param == "smollm2":
        loaded = request.getfixturevalue("smollm2")  # the shared session fixture
        return Case(loaded, request.getfixturevalue("hf_smollm2"))  # conftest: shared
    return _tiny_case(request.param, tmp_path_factory, smol_tokenizer)


def _decode(loop: PagedLoop, pending: dict[int, list[int]], out: dict[int, list]) -> None:
    """Batched decode of every pending sequence until each has NEW_TOKENS tokens."""
    while pending:
        seqs = list(pending)
        logits = loop.step([(s, [pending[s][-1]]) for s in seqs])
        for s, row in zip(seqs, logits, strict=True):
            out[s].append(row)
            pending[s].append(int(row.argmax()))
            if len(pending[s]) == NEW_TOKENS:
                del pending[s]


def _generate(case: Case, i: int, chunks: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    loop, prompt = PagedLoop(case.loaded), case.prompts[i]
    bounds = [0, *chunks, len(prompt)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        logits = loop.step([(0, prompt[lo:hi])])
    tokens, out = [int(logits[0].argmax())], {0: [logits[0]]}
    _decode(loop, {0: tokens}, out)
    return tokens, out[0]


def test_prefill_then_decode(case: Case) -> None:
    case.check(0, *_generate(case, 0, []))


def test_chunked_prefill(case: Case) -> None:
    case.check(1, *_generate(case, 1, [5]))


def test_mixed_batch_then_batched_decode(case: Case) -> None:
    loop, p = PagedLoop(case.loaded), case.prompts
    first = loop.step([(0, p[0])])[0]
    pending, out = {0: [int(first.argmax())]}, {0: [first], 1: [], 2: []}
    # sequence 0 decodes while 1 and 2 prefill, in one flat batch
    logits = loop.step([(0, [pending[0][-1]]), (1, p[1]), (2, p[2])])
    for s, row in enumerate(logits):
        out[s].append(row)
        pending.setdefault(s, []).append(int(row.argmax()))
    tokens = {s: pending[s] for s in pending}
    _decode(loop, pending, out)
    for s in range(3):
        case.check(s, tokens[s], out[s])


def test_kv_cache_sizes(smol_tokenizer) -> None:
    from kvmesh.engine.models.llama import ModelConfig

    cfg = ModelConfig(100, 64, 128, 3, 4, 2, 16)
    assert kv_cache_bytes_per_block(cfg, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 16 * 2
    caches = allocate_kv_cache(cfg, 5, 16, "cpu", torch.float32)
    assert len(caches) == 3 and caches[0].shape == (2, 5, 16, 2, 16)


def test_rejects_unsupported(tmp_path) -> None:
    with pytest.raises(ValueError):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))
