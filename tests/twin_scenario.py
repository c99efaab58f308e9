"""A deterministic run of the router's request path, printed as JSON: the token ids and block
keys of varied prompts (an agent's growing turns, siblings, chats with added tokens, non-ASCII,
small and repeated ones) and the endpoint the kvmesh preset picks for each of a sequence of
requests. tests/test_compiled_twins.py runs it compiled and as pure Python and compares."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

from kvmesh.bench import router_path
from kvmesh.protocol.tokenizer import load_tokenizer
from kvmesh.router.tokens import PromptTokenizer

WORDS = [
    "the",
    "router",
    "keeps",
    "every",
    "prefix",
    "it",
    "has",
    "seen",
    "and",
    "finds",
    "the",
    "engine",
    "holding",
    "most",
]


def prompts() -> list[str]:
    out, agent = [], "<|im_start|>system\nYou are a coding agent.<|im_end|>\n"
    for turn in range(24):
        agent += f"<|im_start|>user\nstep {turn}: " + " ".join(WORDS[turn % 7 :]) + "<|im_end|>\n"
        out.append(agent)
        out.append(agent + f"sibling {turn} naïve café 😀 {turn * 7919}")
    out += [f"Say hello to the router benchmark {i}" for i in range(20)]
    out += ["  leading spaces\n\n\tand tabs\x1c" * 9, "'s 't 're 've 'm 'll 'd" * 12]
    return out + out[:10]


def main() -> None:
    modules = {
        name: getattr(sys.modules[name], "__file__", "")
        for name in ("kvmesh.router.tokens", "kvmesh.router.pipeline", "kvmesh.protocol.hashing")
        if name in sys.modules
    }
    tokenizer = load_tokenizer(None)[0]
    pt = PromptTokenizer(tokenizer)
    digest = hashlib.sha256()
    for text in prompts():
        for special in (True, False):
            ids, keys = pt.ids_and_keys(text, special)
            digest.update(json.dumps([list(ids), keys]).encode())
            pt.settle()
    long = router_path.prompt_text("long")
    requests = [
        router_path.request_bytes(f"group {i % 5}: {long[: 400 * (i % 9 + 1)]} #{i % 13}")
        for i in range(150)
    ]
    picks = asyncio.run(router_path.picks("kvmesh", tokenizer, requests))
    print(json.dumps({"modules": modules, "tokens": digest.hexdigest(), "picks": picks}))


if __name__ == "__main__":
    main()
