"""Input limits on the engine and the router in front of it: request-supplied chat templates
(refused unless trusted; when trusted, sandboxed and rendered on a thread within a budget), JSON
nesting depth, and multi-megabyte prompts (refused by their length when no tokenization could
fit them, else tokenized off the event loop): 400s with OpenAI error bodies, /health answering
all the while."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvmesh.commands.flags import add_dataclass_args, config_from_args
from kvmesh.protocol import chat_template
from kvmesh.protocol.openai import MAX_JSON_DEPTH, nested_too_deeply, opening_brackets
from kvmesh.router.app import Router, RouterConfig, start_router
from tests.conftest import emulated_fleet
from tests.helpers import http, loop_thread

MAX_LEN = 4096
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]
LOOP = "{% for a in range(99999) %}"
FOREVER = LOOP * 3 + "{% endfor %}" * 3  # 10^15 iterations: ends only when interrupted
OWN = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"


@contextlib.contextmanager
def stack(tokenizer, trust: bool):
    """(router url, engine url, router): one emulated engine and a router, each on its own
    event-loop thread, both with --trust-request-chat-template set to `trust`."""
    engine = {"max_model_len": MAX_LEN, "trust_request_chat_template": trust}
    emu = {"emulate_ttft_ms": 1.0, "emulate_itl_ms": 0.1}
    with emulated_fleet(tokenizer, engine=engine, **emu) as (urls, _):

        async def start():
            config = RouterConfig(
                endpoints=urls,
                kv_events=None,
                scrape_interval=0.05,
                trust_request_chat_template=trust,
            )
            router = Router(config, tokenizer)
            return router, await start_router(router, "127.0.0.1", 0)

        async def stop(state) -> None:
            await state[1].cleanup()

        with loop_thread(start, stop) as ((router, server), _):
            url = f"http://127.0.0.1:{server.server.sockets[0].getsockname()[1]}"
            wait_for(lambda: http(url + "/health")[0] == 200)
            yield url, urls[0], router


@pytest.fixture(scope="module")
def untrusted(tokenizer):
    with stack(tokenizer, trust=False) as s:
        yield s


@pytest.fixture(scope="module")
def trusted(tokenizer):
    with stack(tokenizer, trust=True) as s:
        yield s


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def post(url: str, path: str, body: dict | bytes) -> tuple[int, dict]:
    code, _, raw = http(url + path, body)
    out = json.loads(raw)
    if code >= 400:  # an OpenAI error body, never a traceback
        err = out["error"]
        assert err["code"] == code and err["type"] and "Traceback" not in err["message"]
    return code, out


def health(url: str) -> int:
    """GET /health with a short timeout: a stalled event loop fails the test, not hangs it."""
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        return resp.status


def renders() -> int:
    return sum(t.name == "kvmesh-chat-template" for t in threading.enumerate())


def nest(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize("field", ["chat_template", "chat_template_kwargs"])
def test_a_request_template_needs_the_opt_in(untrusted, field):
    value = OWN if field == "chat_template" else {"chat_template": OWN}
    for url in untrusted[:2]:
        code, out = post(url, CHAT, {"messages": HELLO, field: value, "max_tokens": 1})
        assert code == 400 and "--trust-request-chat-template" in out["error"]["message"]
        assert post(url, CHAT, {"messages": HELLO, "max_tokens": 1})[0] == 200


def test_a_trusted_request_template_renders(trusted, tokenizer):
    expect = tokenizer.encode("[user]hi", add_special_tokens=False)
    for url in trusted[:2]:
        body = {"messages": HELLO, "chat_template": OWN, "max_tokens": 1, "return_token_ids": True}
        code, out = post(url, CHAT, body)
        assert code == 200 and out["prompt_token_ids"] == expect
    body = json.dumps({"messages": HELLO, "chat_template_kwargs": {"chat_template": OWN}})
    assert list(trusted[2].scheduling_request(body.encode(), CHAT, {}).token_ids) == expect


def test_a_hostile_template_is_cut_off_while_health_answers(trusted, monkeypatch):
    monkeypatch.setattr(chat_template, "REQUEST_TEMPLATE_SECONDS", 1.0)
    body = {"messages": HELLO, "chat_template": FOREVER, "max_tokens": 1}
    for url in trusted[:2]:  # the router renders it (to route), then the engine
        with ThreadPoolExecutor(1) as pool:
            hostile = pool.submit(post, url, CHAT, body)
            wait_for(lambda: renders() > 0)
            assert [health(u) for u in trusted[:2]] == [200, 200]
            assert not hostile.done()  # answered while the template was rendering
            code, out = hostile.result()
        assert code == 400 and "did not render within 1 s" in out["error"]["message"]
        wait_for(lambda: renders() == 0)  # its thread was interrupted, not left spinning


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.append(1) }}",
    ],
)
def test_templates_render_in_a_sandbox(trusted, tokenizer, template):
    assert chat_template.sandboxed(tokenizer)  # the model's own template renders there too
    for url in trusted[:2]:
        code, out = post(url, CHAT, {"messages": HELLO, "chat_template": template})
        assert code == 400 and "unsafe" in out["error"]["message"]


DEEP = b"[" * 5000 + b"]" * 5000
NESTED = [
    ("/v1/completions", b'{"prompt": ' + DEEP + b"}"),
    ("/v1/completions", b'{"prompt": "hi", "kv_transfer_params": {"a": ' + DEEP + b"}}"),
    (
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi", "tool_calls": [{"a": ' + DEEP + b"}]}]}",
    ),
    (CHAT, json.dumps({"messages": HELLO, "chat_template_kwargs": {"x": nest(70)}}).encode()),
]


@pytest.mark.parametrize("path,body", NESTED, ids=range(len(NESTED)))
def test_json_nested_too_deeply_gets_400(untrusted, path, body):
    for url in untrusted[:2]:
        code, out = post(url, path, body)
        assert code == 400 and "nested too deeply" in out["error"]["message"]
        assert health(url) == 200


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=5000) | st.text(alphabet='{[]}"x\\', max_size=5000).map(str.encode))
@example(b'x{"a": [1, {"b": "[\\"{"}]}' * 300)  # past 2 KiB: the vector pass
@example(bytes(range(256)) * 12)
def test_opening_brackets_are_counted_as_bytes_count_counts_them(body):
    assert opening_brackets(body) == body.count(b"{") + body.count(b"[")


def test_the_depth_limit_is_documented_and_exact(untrusted):
    assert MAX_JSON_DEPTH == 64

    def deep(value) -> bool:
        return nested_too_deeply(json.dumps(value).encode())

    assert not deep(nest(64)) and deep(nest(65))
    assert not deep([1] * 10_000) and deep({"a": nest(64)})
    assert not deep({"a": ["[[[[" * 100, '}}]]\\"[{' * 100], "b": {}})  # brackets in strings
    assert not deep([{}] * 10_000) and deep([1, {"x": [nest(64)]}])
    escapes = ["\\", '\\"', '"\\', '\\\\"[[', "é[", "]\u2028"]  # backslashes before quotes
    assert not deep({"a": [e * 40 for e in escapes], "b": nest(62)})
    assert deep({"a": [e * 40 for e in escapes], "b": nest(64)})
    assert not deep([{"role": "user", "content": "hi"}] * 100_000)  # vector passes, not a regex
    kwargs = {"x": nest(MAX_JSON_DEPTH - 2)}  # the body and chat_template_kwargs: 2 more
    for url in untrusted[:2]:
        body = {"messages": HELLO, "max_tokens": 1, "chat_template_kwargs": kwargs}
        assert post(url, CHAT, body)[0] == 200


def test_a_multi_megabyte_prompt_is_refused_without_tokenizing(untrusted, monkeypatch):
    from kvmesh.engine import serving

    calls: list[int] = []
    real = serving.encode_off_loop
    monkeypatch.setattr(serving, "encode_off_loop", lambda *a: calls.append(1) or real(*a))
    body = {"prompt": "lorem ipsum dolor sit amet " * 150_000, "max_tokens": 1}  # 4 MB
    for url in untrusted[:2]:
        code, out = post(url, "/v1/completions", body)
        message = out["error"]["message"]
        assert code == 400 and "maximum context length is 4096" in message
        assert "at least" in message
    assert not calls  # its length alone showed it cannot fit
    code, out = post(untrusted[1], "/v1/completions", {"prompt": [1] * 5000})  # token ids too
    assert code == 400 and "maximum context length" in out["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_the_router_refuses_a_prompt_no_endpoint_can_hold_without_tokenizing(
    untrusted, monkeypatch, path
):
    """The router knows its endpoints' max_model_len (GET /v1/models): a prompt whose length
    alone shows it cannot fit the largest is refused there, never tokenized nor forwarded."""
    from kvmesh.engine.serving import OpenAIServing

    router = untrusted[2]
    assert router.model_check.largest_context() == MAX_LEN
    calls: list[str] = []

    def spy(name: str, real):
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    tokens = router.tokens
    for name in ("ids_and_keys", "uncached_ids_and_keys", "encode_completion", "block_keys"):
        monkeypatch.setattr(tokens, name, spy(name, getattr(tokens, name)))
    for name in ("parse_completion", "parse_chat"):  # what the engine does first with a request
        monkeypatch.setattr(OpenAIServing, name, spy(name, getattr(OpenAIServing, name)))
    # 2.7 MB: at least 33,334 tokens by its bytes; 150 kB of short words: as many tokens as
    # words (no token covers parts of two), where its bytes gave 1,852
    for text in ("lorem ipsum dolor sit amet " * 100_000, "go " * 50_000):
        body = {"prompt": text}
        if path == CHAT:
            body = {"messages": [{"role": "user", "content": text}]}
        code, out = post(untrusted[0], path, {**body, "max_tokens": 1})
        message = out["error"]["message"]
        assert code == 400 and f"maximum context length is {MAX_LEN} tokens" in message
        assert "requested at least" in message
        assert calls == []  # neither tokenized by the router nor sent to the engine
    small = {"prompt": "hi"} if path != CHAT else {"messages": HELLO}
    assert post(untrusted[0], path, {**small, "max_tokens": 1})[0] == 200
    assert "ids_and_keys" in calls  # (the spies see what the router tokenizes)


def test_long_prompts_are_tokenized_off_the_event_loop(untrusted, monkeypatch):
    """Held inside tokenization (a gate), the engine and the router still answer /health: the
    prompt is tokenized on a worker thread. It is then refused as longer than the context."""
    from kvmesh.engine import serving

    router = untrusted[2]
    entered, release = threading.Event(), threading.Event()

    def gate(real):
        def gated(*args):
            entered.set()
            assert release.wait(30)
            return real(*args)

        return gated

    monkeypatch.setattr(serving, "encode_off_loop", gate(serving.encode_off_loop))
    monkeypatch.setattr(router.tokens, "ids_and_keys", gate(router.tokens.ids_and_keys))
    # 194 kB in 2,000 long words: within the length bounds of both (by bytes and by words; a
    # longer one is refused untokenized), not the context: tokenized, then refused by its count
    short = {"prompt": ("lorem-ipsum-" * 8 + " ") * 2_000, "max_tokens": 1}
    for url, prompt in ((untrusted[0], short), (untrusted[1], short)):
        entered.clear()
        release.clear()
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(post, url, "/v1/completions", prompt)
            assert entered.wait(30)
            assert [health(u) for u in untrusted[:2]] == [200, 200]
            assert not big.done()  # answered while the prompt was being tokenized
            release.set()
            code, out = big.result()
        assert code == 400 and "maximum context length" in out["error"]["message"]


def test_content_parts_and_plain_chat_still_work(untrusted, tokenizer):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello\nworld"}], tokenize=False, add_generation_prompt=True
    )
    expect = tokenizer.encode(text, add_special_tokens=False)
    for content in (parts, "Hello\nworld"):
        messages = [{"role": "user", "content": content}]
        routed = untrusted[2].scheduling_request(
            json.dumps({"messages": messages}).encode(), CHAT, {}
        )
        assert list(routed.token_ids) == expect  # the router keys what the engine computes
        for url in untrusted[:2]:
            body = {"messages": messages, "max_tokens": 2, "return_token_ids": True}
            code, out = post(url, CHAT, body)
            assert code == 200 and out["prompt_token_ids"] == expect
            assert out["choices"][0]["message"]["role"] == "assistant"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    bad_kwargs = {"messages": HELLO, "chat_template_kwargs": {"tokenize": True}}
    for url in untrusted[:2]:
        assert post(url, CHAT, {"messages": image})[0] == 400
        code, out = post(url, CHAT, bad_kwargs)
        assert code == 400 and "may not set tokenize" in out["error"]["message"]


def test_min_tokens_bounds_and_off_loop_encoding_matches(tokenizer):
    from kvmesh.engine.tokenizer import encode, encode_off_loop, min_tokens

    texts = ["x" * 3000, " " * 5000, "-" * 4000, "déjà vu 😀 " * 200, "\x04" * 900 + "a", ""]
    rng = random.Random(37)  # words, whitespace of every kind, vanishing bytes, emoji
    texts += ["".join(rng.choices("ab \n\t\r\x0b\x0c.-é😀\x04 1", k=80)) for _ in range(300)]
    for text in texts:
        ids = encode(tokenizer, text, False)
        assert min_tokens(tokenizer, text) <= len(ids)
        assert encode_off_loop(tokenizer, text, False) == ids
        assert encode_off_loop(tokenizer, text, True) == encode(tokenizer, text, True)
    # no token of this tokenizer covers parts of two words: each word needs one of its own
    assert min_tokens(tokenizer, "go " * 50_000) == 50_000
    assert min_tokens(tokenizer, " a\tb\n\nc  ") == 3


def test_the_opt_in_flag_on_both_commands():
    from kvmesh.commands.router import ROUTER_HELP
    from kvmesh.commands.serve import ENGINE_HELP
    from kvmesh.engine.config import EngineConfig

    for cls, helps in ((EngineConfig, ENGINE_HELP), (RouterConfig, ROUTER_HELP)):
        parser = argparse.ArgumentParser()
        add_dataclass_args(parser, cls, helps)
        assert not config_from_args(cls, parser.parse_args([])).trust_request_chat_template
        args = parser.parse_args(["--trust-request-chat-template"])
        assert config_from_args(cls, args).trust_request_chat_template


def test_the_length_bound_is_read_from_the_vocabulary_at_start():
    """Router and engine read the bound's facts (the whole vocabulary) when they are built,
    never on the event loop when the first long prompt comes."""
    from kvmesh.engine.serving import OpenAIServing
    from kvmesh.engine.tokenizer import load_tokenizer
    from kvmesh.router.request_parser import RequestParser
    from kvmesh.router.tokens import PromptTokenizer

    fresh, _ = load_tokenizer(None)
    assert "_kvmesh_token_span" not in vars(fresh)
    RequestParser(PromptTokenizer(fresh), True, 16).close()
    assert vars(fresh)["_kvmesh_token_span"] is not None
    fresh, _ = load_tokenizer(None)
    OpenAIServing(None, fresh, "m", 1 << 20, ())
    assert vars(fresh)["_kvmesh_token_span"] is not None
