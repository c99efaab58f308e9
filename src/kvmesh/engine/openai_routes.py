"""/v1/completions and /v1/chat/completions, streaming (SSE) and not, in vLLM's shapes."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvmesh.engine.pd import apply_transfer_params, pull_remote
from kvmesh.engine.serving import Choice, OpenAIServing, now_s
from kvmesh.protocol.openai import (
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    encode_json,
    sse_event,
)
from kvmesh.protocol.request_checks import request_id_headers

FINGERPRINT = "kvmesh-0.1.0"
SERVING = web.AppKey("serving", OpenAIServing)
FAULTS = web.AppKey("faults", object)


def _completion_logprobs(serving: OpenAIServing, choice: Choice, start: int = 0) -> dict:
    tok = serving.tokenizer
    entries = choice.logprobs[start:]
    return {
        "tokens": [tok.decode([e[0][0]]) for e in entries],
        "token_logprobs": [e[0][1] for e in entries],
        "top_logprobs": [{tok.decode([t]): lp for t, lp in e[1:]} or None for e in entries],
        "text_offset": [],
    }


def _chat_logprobs(serving: OpenAIServing, entries: list) -> dict:
    tok = serving.tokenizer

    def item(t: int, lp: float) -> dict:
        s = tok.decode([t])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            item(*e[0]) | {"top_logprobs": [item(t, lp) for t, lp in e[1:]]} for e in entries
        ]
    }


async def _stream(
    request: web.Request,
    serving: OpenAIServing,
    reqs,
    choices,
    make_chunk,
    usage_wanted: bool,
    headers: dict,
    first_chunks=(),
) -> web.StreamResponse:
    """Send SSE chunks as tokens arrive; a disconnect ends the stream and aborts the requests."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    gen = serving.run(reqs)
    try:
        first = await anext(gen)  # errors before the first byte are still plain HTTP errors
    except StopAsyncIteration:
        first = None
    await resp.prepare(request)
    for chunk in first_chunks:
        await resp.write(sse_event(chunk))
    faults = request.app.get(FAULTS)
    stall = faults.stall_for() if faults is not None else None
    sent = 0
    try:
        item = first
        while item is not None:
            sent += 1
            if stall is not None and sent == stall[0] + 1:
                await asyncio.sleep(stall[1] * serving.engine.time_scale)  # injected stall
            i, out = item
            serving.accumulate(choices[i], out)
            if out.error:
                await resp.write(
                    sse_event(
                        {
                            "error": {
                                "message": out.error,
                                "type": "InternalServerError",
                                "code": 500,
                            }
                        }
                    )
                )
            elif out.text or out.token_ids or out.finished:
                await resp.write(sse_event(make_chunk(choices[i], out)))
            item = await anext(gen, None)
        if usage_wanted:
            chunk = make_chunk(None, None)
            chunk["usage"] = serving.usage(choices)
            await resp.write(sse_event(chunk))
        await resp.write(SSE_DONE)
    finally:
        await gen.aclose()
    return resp


def _envelope(rid: str, obj: str, created: int, model: str) -> dict:
    """The fields every completion body and chunk starts with."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [],
    }


async def completions(request: web.Request) -> web.StreamResponse:
    serving: OpenAIServing = request.app[SERVING]
    body = await request.read()
    prompt = serving.parse_completion(body)  # first, as the router checks it
    req: CompletionRequest = decode_request(body, CompletionRequest)
    serving.check_model(req.model)
    if req.echo or req.suffix:
        raise APIError("echo and suffix are not supported.", param="echo")
    _check_token_lists(serving, prompt.prompts, req.max_tokens)
    base = serving.request_id(request.headers, req.request_id)
    reqs, choices = [], []
    special = prompt.add_special_tokens
    for i, p in enumerate(prompt.prompts):
        if isinstance(p, str):
            ids = await serving.tokenize(p, special, req.max_tokens, "prompt")
        else:
            ids = list(p)
        params = serving.sampling_params(req, len(ids), req.max_tokens, req.logprobs)
        reqs.append(serving.make_request(base, i, ids, params, req))
        choices.append(Choice(i, ids))
    rid, created, name = f"cmpl-{base}", now_s(), serving.model_name
    headers = request_id_headers(base)
    await _transfer(serving, reqs[0], req.kv_transfer_params)

    def chunk(choice: Choice | None, out) -> dict:
        body = _envelope(rid, "text_completion", created, name)
        if choice is not None:
            c = {
                "index": choice.index,
                "text": out.text,
                "logprobs": None,
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None,
            }
            if req.logprobs is not None and out.token_ids:
                c["logprobs"] = _completion_logprobs(serving, choice, -len(out.token_ids))
            if req.return_token_ids:
                c["token_ids"] = out.token_ids
            body["choices"].append(c)
        return body

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _stream(request, serving, reqs, choices, chunk, include_usage, headers)
    async for i, out in serving.run(reqs):
        serving.accumulate(choices[i], out)
    _raise_errors(choices)
    body = {
        **_envelope(rid, "text_completion", created, name),
        "usage": serving.usage(choices),
        "kv_transfer_params": choices[0].kv_transfer_params,
    }
    for c in choices:
        body["choices"].append(
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": _completion_logprobs(serving, c) if req.logprobs is not None else None,
                "token_ids": c.token_ids if req.return_token_ids else None,
                "prompt_token_ids": c.prompt_ids if req.return_token_ids else None,
            }
        )
    return web.Response(body=encode_json(body), content_type="application/json", headers=headers)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    serving: OpenAIServing = request.app[SERVING]
    body = await request.read()
    chat = await serving.parse_chat(body)  # first, as the router checks it
    req: ChatCompletionRequest = decode_request(body, ChatCompletionRequest)
    serving.check_model(req.model)
    max_tokens = req.max_completion_tokens or req.max_tokens
    ids = await serving.chat_ids(chat, max_tokens)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
    params = serving.sampling_params(req, len(ids), max_tokens, top if req.logprobs else None)
    base = serving.request_id(request.headers, req.request_id)
    reqs, choices = [serving.make_request(base, 0, ids, params, req)], [Choice(0, ids)]
    rid, created, name = f"chatcmpl-{base}", now_s(), serving.model_name
    headers = request_id_headers(base)
    await _transfer(serving, reqs[0], req.kv_transfer_params)

    def chunk(choice: Choice | None, out) -> dict:
        body = _envelope(rid, "chat.completion.chunk", created, name)
        if choice is not None:
            c = {
                "index": 0,
                "delta": {"content": out.text} if out.text else {},
                "logprobs": None,
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None,
            }
            if req.logprobs and out.logprobs:
                c["logprobs"] = _chat_logprobs(serving, out.logprobs)
            if req.return_token_ids:
                c["token_ids"] = out.token_ids
            body["choices"].append(c)
        return body

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        role = {
            **_envelope(rid, "chat.completion.chunk", created, name),
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        return await _stream(
            request, serving, reqs, choices, chunk, include_usage, headers, first_chunks=(role,)
        )
    async for i, out in serving.run(reqs):
        serving.accumulate(choices[i], out)
    _raise_errors(choices)
    c = choices[0]
    body = {
        **_envelope(rid, "chat.completion", created, name),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                "logprobs": _chat_logprobs(serving, c.logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": c.token_ids if req.return_token_ids else None,
            }
        ],
        "usage": serving.usage(choices),
        "prompt_token_ids": c.prompt_ids if req.return_token_ids else None,
        "kv_transfer_params": c.kv_transfer_params,
    }
    return web.Response(body=encode_json(body), content_type="application/json", headers=headers)


def _check_token_lists(serving: OpenAIServing, prompts: list, max_tokens: int | None) -> None:
    """Token-id prompts past the context are refused by their length, before their ids are
    checked against the vocabulary."""
    for p in prompts:
        if isinstance(p, list):
            serving.check_room(len(p), max_tokens, "prompt")


async def _transfer(serving: OpenAIServing, request, params: dict | None) -> None:
    """P/D: a prefill request holds its blocks; a decode request first pulls the prefill's."""
    pull = apply_transfer_params(request, params)
    if pull is not None:
        await pull_remote(serving.engine, serving.transfer_key, request, pull)


def _raise_errors(choices: list[Choice]) -> None:
    for c in choices:
        if c.error:
            raise APIError(c.error, 500)
