"""One prompt path for router and engine (protocol.prompt): for any chat request both make the
token ids that transformers' apply_chat_template makes (vLLM's reference), refuse the same bad
requests with the same 400, and the router keys what the engine's /tokenize answers."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.engine.serving import OpenAIServing
from kvmesh.protocol.chat_template import PromptError
from kvmesh.protocol.conversation import loops_over_content
from kvmesh.protocol.prompt import chat_prompt, chat_text, decode_chat
from kvmesh.router.app import Router, RouterConfig, start_router
from kvmesh.router.request_parser import RequestParser
from kvmesh.router.tokens import PromptTokenizer
from tests.conftest import emulated_fleet
from tests.helpers import bound_port, http, loop_thread

CHAT = "/v1/chat/completions"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def stack(tokenizer):
    """(router url, engine url, router): an emulated engine with the kvmesh-preset router."""
    emu = {"emulate_ttft_ms": 1.0, "emulate_itl_ms": 0.1}
    with emulated_fleet(tokenizer, engine={"max_model_len": 4096}, **emu) as (urls, _):

        async def start():
            config = RouterConfig(endpoints=urls, kv_events=None, scrape_interval=0.05)
            router = Router(config, tokenizer)
            return router, await start_router(router, "127.0.0.1", 0)

        async def stop(state) -> None:
            await state[1].cleanup()

        with loop_thread(start, stop) as ((router, server), _):
            yield f"http://127.0.0.1:{bound_port(server)}", urls[0], router


@pytest.fixture(scope="module")
def sides(tokenizer):
    """(router's parser, engine's serving): each side's own prompt path, in process."""
    parser = RequestParser(PromptTokenizer(tokenizer, min_run_chars=32, cut_stride=4), True, 16)
    yield parser, OpenAIServing(None, tokenizer, "m", 1 << 20, ())
    parser.close()


def router_ids(parser: RequestParser, body: dict) -> list[int]:
    return list(parser.scheduling_request(json.dumps(body).encode(), CHAT, {}).token_ids)


def engine_ids(serving: OpenAIServing, body: dict) -> list[int]:
    async def run() -> list[int]:
        return await serving.chat_ids(await serving.parse_chat(json.dumps(body).encode()), None)

    return asyncio.run(run())


def reference_ids(tokenizer, body: dict) -> list[int]:
    """transformers' apply_chat_template on the messages as vLLM hands them over: text parts
    joined by newlines."""
    messages = []
    for m in body["messages"]:
        content = m["content"]
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        messages.append({**m, "content": content})
    return tokenizer.apply_chat_template(
        messages,
        tools=body.get("tools"),
        tokenize=True,
        return_dict=False,
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
    )


def outcome(fn, *args):
    """ids, or ("error", message) for a refused request."""
    try:
        return fn(*args)
    except (PromptError, ValueError) as exc:
        return ("error", getattr(exc, "message", str(exc)))


texts = st.lists(
    st.one_of(
        st.sampled_from(["Hello", " world", "\n", "  ", "déjà vu", "😀", "x = f(1)", "<|im_end|>"]),
        st.text(max_size=8),
    ),
    max_size=6,
).map("".join)
contents = st.one_of(
    texts, st.lists(texts.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=3)
)
messages = st.lists(
    st.builds(
        lambda role, content: {"role": role, "content": content},
        st.sampled_from(["system", "user", "assistant", "tool"]),
        contents,
    ),
    min_size=1,
    max_size=5,
)
chats = st.builds(
    lambda msgs, gen, cont, tools: {
        "messages": msgs,
        **({} if gen is None else {"add_generation_prompt": gen}),
        **({"continue_final_message": True} if cont else {}),
        **({"tools": [TOOL]} if tools else {}),
    },
    messages,
    st.sampled_from([None, True, False]),
    st.booleans(),
    st.booleans(),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=chats)
def test_router_engine_and_reference_make_the_same_ids(tokenizer, sides, stack, body):
    parser, serving = sides
    routed = outcome(router_ids, parser, body)
    engine = outcome(engine_ids, serving, body)
    assert routed == engine, body
    code, _, raw = http(stack[1] + "/tokenize", body)
    if isinstance(engine, list):
        assert code == 200 and json.loads(raw)["tokens"] == engine, body
        assert engine == reference_ids(tokenizer, body), body
    else:  # refused alike, and by the reference
        assert code == 400 and json.loads(raw)["error"]["message"] == engine[1], body
        with pytest.raises(ValueError):
            reference_ids(tokenizer, body)


def test_issue_requests_through_the_router(tokenizer, stack):
    router_url, engine_url, router = stack
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    code, _, raw = http(router_url + CHAT, {**parts, "max_tokens": 2})
    assert code == 200 and json.loads(raw)["choices"][0]["message"]["role"] == "assistant"

    prefill = {
        "messages": [
            {"role": "user", "content": "Write a haiku about caches."},
            {"role": "assistant", "content": "Blocks remembered,"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    routed = list(router.scheduling_request(json.dumps(prefill).encode(), CHAT, {}).token_ids)
    tokenized = json.loads(http(engine_url + "/tokenize", prefill)[2])["tokens"]
    expect = reference_ids(tokenizer, prefill)
    assert routed == tokenized == expect
    # continuing leaves the final message open: no end-of-turn after it, no new header
    assert tokenizer.decode(routed).endswith("Blocks remembered,")
    code, _, raw = http(router_url + CHAT, {**prefill, "max_tokens": 2, "return_token_ids": True})
    assert code == 200 and json.loads(raw)["prompt_token_ids"] == expect


BAD_CHATS = [
    {"messages": []},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
    {
        "messages": [{"role": "user", "content": "hi"}],
        "continue_final_message": True,
        "add_generation_prompt": True,
    },
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"type": "custom"}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"},
    # the router keys no image (a multimodal vLLM would take it): the engine's own 400
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
]
BAD_COMPLETIONS = [{"prompt": [{"a": 1}]}, {"prompt": []}, {"prompt": 5}, {"max_tokens": 2}]


@pytest.mark.parametrize(
    "path,body",
    [(CHAT, b) for b in BAD_CHATS] + [("/v1/completions", b) for b in BAD_COMPLETIONS],
)
def test_router_and_engine_refuse_alike(stack, path, body):
    router_url, engine_url, _ = stack
    answers = []
    for url in (router_url, engine_url):
        code, _, raw = http(url + path, body)
        err = json.loads(raw)["error"]
        answers.append((code, err["message"], err["type"], err["code"]))
    assert answers[0] == answers[1] and answers[0][0] == 400, answers


OPENAI_FORMAT = (
    "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}{% endfor %}"
)


def test_template_looping_over_content_gets_text_parts(tokenizer):
    assert not loops_over_content(tokenizer.chat_template)
    assert loops_over_content(OPENAI_FORMAT)
    parts = [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]
    body = {"messages": [{"role": "user", "content": parts}, {"role": "tool", "content": parts}]}
    chat = chat_prompt(decode_chat(json.dumps(body).encode()), tokenizer, OPENAI_FORMAT)
    # a tool message's text parts are one string, as vLLM passes them
    assert chat_text(tokenizer, chat) == "[user]<a><b>[tool]a\nb"
    plain = chat_prompt(decode_chat(json.dumps(body).encode()), tokenizer, None)
    assert plain.messages[0]["content"] == "a\nb"


def test_tool_call_arguments_reach_templates_as_objects(tokenizer):
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}:{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}"
    )
    calls = [
        {"type": "function", "function": {"name": "a", "arguments": '{"city": "Paris"}'}},
        {"type": "function", "function": {"name": "b", "arguments": "{not json"}},
        {"function": {"name": "c"}},
    ]
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}
    chat = chat_prompt(decode_chat(json.dumps(body).encode()), tokenizer, template)
    assert chat_text(tokenizer, chat) == 'a:{"city": "Paris"};b:{};c:{};'
    assert chat.messages[0]["content"] == ""  # no content: the empty string, as vLLM's
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is untouched


def test_documents_kwargs_and_bare_string_parts_reach_the_template(tokenizer, stack):
    template = (
        "{% for d in documents %}({{ d.title }}){% endfor %}{{ greeting }}"
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    body = {
        "messages": [{"role": "user", "content": ["a", {"type": "text", "text": "b"}]}],
        "documents": [{"title": "T1", "text": "x"}, {"title": "T2", "text": "y"}],
        "chat_template_kwargs": {"greeting": "hey"},
    }
    chat = chat_prompt(decode_chat(json.dumps(body).encode()), tokenizer, template)
    assert chat_text(tokenizer, chat) == "(T1)(T2)hey[a\nb]"
    image = BAD_CHATS[-1]
    assert stack[2].scheduling_request(json.dumps(image).encode(), CHAT, {}).token_ids == []


def test_a_repeated_prompt_is_keyed_from_the_whole_prompt_cache(tokenizer):
    """The same text again (a completion's, or a chat's rendering) takes its ids and keys from
    the cache; a prompt of token ids is keyed as the same ids given as text."""
    parser = RequestParser(PromptTokenizer(tokenizer), True, 16)
    try:
        text = "Summarise the design of a router that keeps prefixes where they are cached. " * 3

        def routed(path: str, body: dict):
            return parser.scheduling_request(json.dumps(body).encode(), path, {})

        def hits() -> int:  # a short text's repeats hit the whole-prompt cache, a long one's
            st = parser.tokens.stats  # the text cache
            return st.whole_hits + st.exact_hits

        first = routed("/v1/completions", {"prompt": text, "max_tokens": 1})
        before = hits()
        again = routed("/v1/completions", {"prompt": text, "max_tokens": 7, "seed": 3})
        assert hits() == before + 1
        assert (again.token_ids, again.block_keys) == (first.token_ids, first.block_keys)
        assert list(first.token_ids) == tokenizer.encode(text) and len(first.block_keys) >= 2
        given = routed("/v1/completions", {"prompt": list(first.token_ids)})
        assert given.block_keys == first.block_keys
        salted = routed("/v1/completions", {"prompt": text, "cache_salt": "tenant-a"})
        assert list(salted.token_ids) == list(first.token_ids)
        assert salted.block_keys != first.block_keys
        chat = {"messages": [{"role": "user", "content": text}]}
        one = routed(CHAT, chat)
        before = hits()
        two = routed(CHAT, chat)
        assert two.block_keys == one.block_keys and hits() == before + 1
    finally:
        parser.close()
