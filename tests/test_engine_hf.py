"""The whole engine (scheduler, paged cache, prefix cache, chunked prefill, preemption) gives the
same greedy tokens as HF transformers `generate` on SmolLM2."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.builder import assemble
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.engine.torch_runner import TorchRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "A long time ago in a galaxy far, far away, there lived a young farmer who dreamed of",
    "List three prime numbers:",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_reference(smollm2, hf_smollm2):
    model = hf_smollm2  # HF's own load of the GGUF (conftest, shared with test_model_hf)
    out = {}
    for p in PROMPTS:
        ids = smollm2.tokenizer.encode(p)
        with torch.inference_mode():
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        out[p] = (ids, gen[0, len(ids) :].tolist())
    return out


def run_engine(smollm2, prompts: list[list[int]], **cfg) -> list[list[int]]:
    config = EngineConfig(**cfg)
    bundle = assemble(config, TorchRunner(config, smollm2), smollm2.tokenizer, "m", "p", ())
    core = bundle.engine.core
    reqs = [
        Request(str(i), ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
        for i, ids in enumerate(prompts)
    ]
    for r in reqs:
        core.add_request(r)
    for _ in range(2000):
        if not core.has_work():
            break
        core.step()
    bundle.publisher.close()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_gpu_blocks=128),  # plain continuous batching
        dict(num_gpu_blocks=128, max_num_batched_tokens=7),  # chunked prefill in 7-token slices
        dict(num_gpu_blocks=9, block_size=4, max_num_batched_tokens=64),  # forces preemption
    ],
    ids=["batched", "chunked", "preempting"],
)
def test_engine_greedy_equals_hf(smollm2, hf_reference, cfg):
    prompts = [hf_reference[p][0] for p in PROMPTS]
    got = run_engine(smollm2, prompts, **cfg)
    for p, tokens in zip(PROMPTS, got, strict=True):
        assert tokens == hf_reference[p][1], p


def test_prefix_cached_run_equals_cold(smollm2, hf_reference):
    prompts = [hf_reference[p][0] for p in PROMPTS]
    shared = prompts[2]
    got = run_engine(
        smollm2, [shared, shared + [], shared], num_gpu_blocks=128, block_size=4, max_num_seqs=1
    )
    assert got[0] == got[1] == got[2] == hf_reference[PROMPTS[2]][1]
