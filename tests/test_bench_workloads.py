"""Workload generators: deterministic in the seed, exact token counts with the real tokenizer,
trace block reuse equal to the trace's hash_id reuse, and the hit-rate ceiling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench import workloads as w
from kvmesh.protocol.trace import TRACE_BLOCK

TRACE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl")


def test_vocabulary_words_are_single_tokens(tokenizer) -> None:
    for word in w.VOCAB:
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word


def test_token_id_prompts_are_the_text_tokenized(tokenizer) -> None:
    """--prompt-format ids sends what tokenizing " " + the prompt's text gives: same words,
    same count, the same blocks wherever the text's blocks are equal."""
    vocab = tokenizer.encode("".join(" " + v for v in w.VOCAB), add_special_tokens=False)
    assert len(vocab) == len(w.VOCAB)
    wl = w.agentic(sessions=2, turns=2, system_tokens=120, repo_tokens=200, seed=5)
    for r in wl.requests[:4]:
        ids = wl.token_ids(r, vocab)
        assert len(ids) == r.prompt_tokens
        assert ids == tokenizer.encode(" " + wl.text(r), add_special_tokens=False)


def test_generators_are_deterministic_in_the_seed() -> None:
    for make in (w.agentic, w.shared_prefix):
        a, b, c = make(seed=3), make(seed=3), make(seed=4)
        assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
        assert [a.text(r) for r in a.requests[:5]] == [b.text(r) for r in b.requests[:5]]
        assert [a.text(r) for r in a.requests[:5]] != [c.text(r) for r in c.requests[:5]]


def test_prompt_text_has_exactly_its_token_count(tokenizer) -> None:
    wl = w.agentic(
        sessions=3,
        turns=3,
        system_tokens=300,
        tool_def_tokens=200,
        repo_tokens=500,
        fanout_rate=1.0,
        fanout=2,
        seed=1,
    )
    sp = w.shared_prefix(groups=2, prompts_per_group=2, system_tokens=100, seed=1)
    for load in (wl, sp):
        for r in load.requests:
            ids = tokenizer.encode(load.text(r), add_special_tokens=False)
            assert len(ids) == r.prompt_tokens


def test_agentic_contexts_grow_and_subagents_share_the_parents_prefix() -> None:
    wl = w.agentic(sessions=2, turns=4, fanout=3, fanout_rate=1.0, sub_turns=2, seed=0)
    by_rid = {r.rid: r for r in wl.requests}
    for r in wl.requests:
        assert r.prompt[:2] == (("system", 1500), ("tools", 1500))
        for d in r.deps:
            parent = by_rid[d]
            assert d < r.rid and parent.session == r.session
            if parent.agent == r.agent or r.agent.startswith(parent.agent + "."):
                assert r.prompt[: len(parent.prompt)] == parent.prompt  # context only grows
    children = [r for r in wl.requests if r.agent.count(".") == 2]
    assert len(children) == 2 * 3 * 3 * 2  # sessions x fan-outs x width x sub-turns
    joins = [r for r in wl.requests if len(r.deps) == 3]  # the parent waits for all children
    assert len(joins) == 2 * 3


def test_ceiling_counts_leading_blocks_seen_before() -> None:
    a = w.Request(0, 0, (("x", 64),), 1)
    b = w.Request(1, 1, (("x", 40), ("y", 30)), 1)  # 2 full shared blocks, then differs
    c = w.Request(2, 2, (("x", 64),), 1)  # all 4 seen, but the last block is never a hit
    got = w.hit_ceiling([a, b, c])
    assert got["hit_tokens"] == 32 + 48 and got["prompt_tokens"] == 64 + 70 + 64
    assert w.hit_ceiling([w.Request(0, 0, (("z", 5),), 1)])["hit_tokens"] == 0


def test_shared_prefix_ceiling_is_analytic() -> None:
    wl = w.shared_prefix(groups=4, prompts_per_group=5, system_tokens=160, question_tokens=40)
    got = w.hit_ceiling(wl.requests)
    assert got["hit_tokens"] == 4 * 4 * 160  # every prompt but the first of a group hits 160


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake trace not present")
def test_trace_block_reuse_equals_hash_id_reuse(tokenizer) -> None:
    wl = w.mooncake(TRACE, limit=300, time_scale=0.5)
    rows = [json.loads(line) for _, line in zip(range(300), TRACE.open(), strict=False)]
    seen: set[int] = set()
    expect = 0
    for row, r in zip(rows, wl.requests, strict=True):
        assert r.prompt_tokens == row["input_length"]
        assert r.max_tokens == max(1, row["output_length"])
        assert r.at == pytest.approx((row["timestamp"] - rows[0]["timestamp"]) / 1000 * 0.5)
        n, run = row["input_length"], 0
        for j, h in enumerate(row["hash_ids"]):  # a 16-block hits iff its 512-block was seen,
            if h not in seen:  # in full (only the last block of a prompt can be cut)
                break
            run = j + 1
        expect += min(run * TRACE_BLOCK, (n - 1) // 16 * 16)
        seen.update(row["hash_ids"][: n // TRACE_BLOCK])
    got = w.hit_ceiling(wl.requests)
    assert abs(got["hit_tokens"] - expect) <= 0.002 * got["prompt_tokens"]
    # the text: equal hash ids give equal token blocks at equal offsets
    r0, r1 = wl.requests[0], wl.requests[1]
    t0 = tokenizer.encode(wl.text(r0), add_special_tokens=False)
    t1 = tokenizer.encode(wl.text(r1), add_special_tokens=False)
    assert len(t0) == r0.prompt_tokens and len(t1) == r1.prompt_tokens
    assert t0[:512] == t1[:512] and t0[512:1024] != t1[512:1024]  # block 0 shared, then not
    rate = w.mooncake(TRACE, limit=300, rate=10.0)
    assert (len(rate.requests) - 1) / rate.requests[-1].at == pytest.approx(10.0)


def test_command_line_builds_each_workload() -> None:
    import argparse

    from kvmesh.bench import cli_args, workload_cmd

    for kind, flags in (
        ("agentic", ["--sessions", "2", "--turns", "2", "--fanout", "0"]),
        ("shared-prefix", ["--groups", "2", "--prompts-per-group", "3", "--rate", "4"]),
        ("trace", ["--trace", str(TRACE), "--trace-limit", "5", "--time-scale", "0.1"]),
    ):
        if kind == "trace" and not TRACE.exists():
            continue
        parser = argparse.ArgumentParser()
        workload_cmd.add_args_workload(parser, kind)
        wl = cli_args.build_workload(parser.parse_args(flags), kind)
        assert wl.kind == kind and wl.requests
    assert len(wl.requests) == 5
    parser = argparse.ArgumentParser()
    cli_args.add_workload_args(parser)  # every kind at once: shared flags appear once
    args = parser.parse_args(["--workload", "shared-prefix", "--system-tokens", "64"])
    wl = cli_args.build_workload(args, groups=1, prompts_per_group=2)
    assert [r.prompt[0] for r in wl.requests] == [("sp0", 64)] * 2
