"""The engine's OpenAI surface, through the real `openai` client and raw HTTP.

Surface tests run against both runners from one parametrised fixture: the torch runner on
SmolLM2 and the emulated runner (same server, scheduler, block pool, events and metrics)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest

from tests.conftest import emulated_fleet, engine_server
from tests.helpers import http

PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=["torch", "emulated"])
def server(request):
    if request.param == "torch":
        with engine_server(request.getfixturevalue("smollm2"), max_waiting_requests=64) as (
            url,
            bundle,
        ):
            yield url, bundle
    else:
        tok = request.getfixturevalue("tokenizer")
        with emulated_fleet(tok, engine={"num_gpu_blocks": 256, "max_model_len": 2048}) as (
            urls,
            fleet,
        ):
            yield urls[0], fleet.bundles[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server):
    return server[1].model_name


def test_models_health_version(server):
    url, bundle = server
    status, _, body = http(url + "/v1/models")
    card = json.loads(body)["data"][0]
    assert status == 200 and card["id"] == bundle.model_name
    assert card["max_model_len"] == bundle.max_model_len
    assert http(url + "/health")[0] == 200
    assert json.loads(http(url + "/version")[2])["version"]


def test_completion_usage_and_length_finish(client, model):
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_prefix_hit_same_output_and_cached_tokens(client, model):
    prompt = "Once upon a time " * 12  # 48+ tokens: several full blocks of 16
    kw = dict(model=model, prompt=prompt, max_tokens=12, temperature=0)
    cold = client.completions.create(**kw)
    warm = client.completions.create(**kw)
    assert warm.choices[0].text == cold.choices[0].text
    n = cold.usage.prompt_tokens
    assert warm.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16


def test_chat_streaming_with_usage(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_non_stream_matches_stream(client, model):
    kw = dict(
        model=model,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": "Name a color."}],
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert full == streamed


def test_completion_stream_text_equals_non_stream(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert full == streamed


def test_stop_string_truncates(client, model):
    kw = dict(
        model=model,
        prompt="Tell me a story:",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**kw).choices[0].text
    words = [w for w in text.split() if len(w) > 2]
    stop = words[len(words) // 2]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_shape(client, model):
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)


def test_request_id_header_honoured(server):
    url, _ = server
    status, headers, body = http(
        url + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2},
        headers={"X-Request-Id": "abc123"},
    )
    assert status == 200 and json.loads(body)["id"] == "cmpl-abc123"
    assert headers["X-Request-Id"] == "abc123"


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b"{not json", 400, "Malformed JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "Invalid request"),
        ({"prompt": PROMPT, "model": "nope"}, 404, "does not exist"),
        ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
        ({"prompt": PROMPT, "max_tokens": "x"}, 400, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": PROMPT, "n": 2}, 400, "n=1"),
        ({"prompt": PROMPT, "logprobs": 99}, 400, "logprobs"),
        ({"prompt": "hi " * 3000, "max_tokens": 4}, 400, "maximum context length"),
        ({"prompt": [999999999]}, 400, "Token ids"),
        ({"prompt": [{"a": 1}]}, 400, "prompt"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ],
)
def test_bad_input_gets_openai_error(server, body, status, needle):
    url, _ = server
    chat = isinstance(body, dict) and "messages" in body
    code, _, raw = http(url + ("/v1/chat/completions" if chat else "/v1/completions"), body)
    err = json.loads(raw)["error"]
    assert code == status and needle in err["message"]
    assert err["code"] == status and err["type"]
    assert "Traceback" not in raw.decode()


def test_oversized_body_gets_413_json(server):
    code, _, raw = http(server[0] + "/v1/completions", b"{" + b" " * (33 * 2**20) + b"}")
    assert code == 413 and json.loads(raw)["error"]["code"] == 413


def test_tokenize_detokenize(server):
    url, _ = server
    tok = json.loads(http(url + "/tokenize", {"prompt": PROMPT})[2])
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    assert json.loads(http(url + "/detokenize", {"tokens": tok["tokens"]})[2])["prompt"] == PROMPT
    chat = json.loads(http(url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2])
    assert chat["count"] > 2
    prefill = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "Hello"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    chat = json.loads(http(url + "/tokenize", prefill)[2])
    body = {**prefill, "max_tokens": 1, "return_token_ids": True}
    out = json.loads(http(url + "/v1/chat/completions", body)[2])
    assert chat["tokens"] == out["prompt_token_ids"]  # one prompt path for both routes
    assert chat["token_strs"] is None and chat["count"] == len(chat["tokens"])


def test_metrics_have_vllm_names(server, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    text = http(server[0] + "/metrics")[2].decode()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:cache_config_info",
        "vllm:request_success_total",
    ):
        assert name in text, name
    assert f'model_name="{model}"' in text and 'engine="0"' in text


def test_client_disconnect_aborts_and_frees_blocks(server):
    url, bundle = server
    body = json.dumps(
        {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    resp = urllib.request.urlopen(req, timeout=60)
    resp.readline()  # the first chunk arrived: the request is running
    resp.close()
    kv = bundle.engine.core.kv
    deadline = time.time() + 30
    while time.time() < deadline and (
        bundle.engine.num_unfinished or kv.pool.num_free_blocks != kv.pool.num_blocks
    ):
        time.sleep(0.05)
    assert bundle.engine.num_unfinished == 0
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    text = http(url + "/metrics")[2].decode()
    assert 'finished_reason="abort"' in text


# ---- model quality: the torch runner only --------------------------------------------------


@pytest.fixture(scope="module")
def torch_client(smollm2):
    with engine_server(smollm2) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_greedy_answer_is_right(torch_client):
    r = torch_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_seed_reproducible_sampling(torch_client):
    kw = dict(
        model="SmolLM2-135M-Instruct",
        prompt="Write a list of fruits:",
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "min_p": 0.01},
    )
    a = torch_client.completions.create(**kw).choices[0].text
    assert a == torch_client.completions.create(**kw).choices[0].text
    kw["seed"] = 4321
    assert a != torch_client.completions.create(**kw).choices[0].text


def test_concurrent_requests_batch_without_changing_greedy_output(torch_client):
    results: dict[int, str] = {}

    def go(i: int) -> None:
        r = torch_client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=f"{i} + {i} =", max_tokens=6, temperature=0
        )
        results[i] = r.choices[0].text

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 6
    solo = (
        torch_client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="3 + 3 =", max_tokens=6, temperature=0
        )
        .choices[0]
        .text
    )
    assert solo == results[3]
