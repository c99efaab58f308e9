"""OpenAI serving: API requests become engine Requests; engine outputs become API responses."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from kvmesh.engine.async_engine import AsyncEngine, EngineOverloaded
from kvmesh.engine.core import RequestOutput
from kvmesh.engine.sequence import Request, SamplingParams
from kvmesh.protocol.chat_template import request_template
from kvmesh.protocol.openai import (
    APIError,
    ChatCompletionRequest,
    context_length_error,
)
from kvmesh.protocol.prompt import (
    ChatPrompt,
    CompletionPrompt,
    chat_prompt,
    chat_text,
    check_choices,
    completion_prompt,
    decode_chat,
    decode_completion,
)
from kvmesh.protocol.request_checks import check_request_id
from kvmesh.protocol.tokenizer import encode, encode_off_loop, min_tokens, token_span

_counter = itertools.count()
logger = logging.getLogger(__name__)
OFF_LOOP_CHARS = 64 * 1024  # prompts this long are rendered and tokenized on a worker thread


@dataclass(slots=True)
class Choice:
    """Accumulated state of one choice (one prompt) of a request."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer,
        model_name: str,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        max_logprobs: int = 20,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        token_span(tokenizer)  # read from the vocabulary now, not by a long prompt on the loop
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_logprobs = max_logprobs
        self.transfer_key: str | None = None  # the KV-transfer key (builder sets it)
        self.trust_request_chat_template = False  # server.build_app sets it from the config
        self.max_choices_per_request = 256  # the builder sets it from the config

    # ---- input side -------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist.", 404, "model")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(self.tokenizer, text, add_special_tokens)

    def check_room(
        self, prompt_len: int, max_tokens: int | None, param: str, least: bool = False
    ) -> int:
        """Room left for the completion; a prompt (plus max_tokens) past the context: 400
        (``least``: prompt_len is a lower bound)."""
        room, limit = self.max_model_len - prompt_len, self.max_model_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise context_length_error(limit, prompt_len, max_tokens or 0, param, least)
        return room

    async def tokenize(
        self, text: str, special: bool, max_tokens: int | None, param: str, check: bool = True
    ) -> list[int]:
        """A prompt's token ids. A long one is first refused when no tokenization could fit it
        in the context (``check``), else tokenized on a worker thread, the event loop free."""
        if len(text) < OFF_LOOP_CHARS:
            return self.encode(text, special)
        least = min_tokens(self.tokenizer, text) if check else 0  # 0: no bound known
        if least:
            self.check_room(least, max_tokens, param, least=True)
        return await asyncio.to_thread(encode_off_loop, self.tokenizer, text, special)

    # Prompts are made by protocol.prompt, as the router makes them: the same checks in the same
    # order, so both refuse a bad request with the same 400 and key the same token ids.
    async def parse_chat(self, body: bytes) -> ChatPrompt:
        """A chat body's prompt, checked; a large body is checked on a worker thread."""
        if len(body) < OFF_LOOP_CHARS:
            return self._chat_prompt(body)
        return await asyncio.to_thread(self._chat_prompt, body)

    def _chat_prompt(self, body: bytes) -> ChatPrompt:
        fields = decode_chat(body)
        trusted = self.trust_request_chat_template
        template = request_template(fields.chat_template, fields.chat_template_kwargs, trusted)
        chat = chat_prompt(fields, self.tokenizer, template)
        check_choices(fields, self.max_choices_per_request)
        return chat

    def parse_completion(self, body: bytes) -> CompletionPrompt:
        """A completion body's prompts, checked: at most max_choices_per_request of them."""
        fields = decode_completion(body)
        prompt = completion_prompt(fields)
        check_choices(fields, self.max_choices_per_request)
        return prompt

    async def chat_ids(
        self, chat: ChatPrompt, max_tokens: int | None, check: bool = True
    ) -> list[int]:
        """Token ids of a chat; a long chat, or one with its own template, is rendered on a
        worker thread, and its text tokenized as ``tokenize`` does."""
        if chat.template is None and chat.chars < OFF_LOOP_CHARS:
            text = chat_text(self.tokenizer, chat)
        else:
            text = await asyncio.to_thread(chat_text, self.tokenizer, chat)
        return await self.tokenize(text, chat.add_special_tokens, max_tokens, "messages", check)

    def sampling_params(
        self, req, prompt_len: int, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        if req.n != 1:
            raise APIError("Only n=1 is supported.", param="n")
        for name, neutral in (
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
        ):
            if getattr(req, name) != neutral:
                raise APIError(f"{name} is not supported by this engine.", param=name)
        if prompt_len == 0:
            raise APIError("The prompt is empty.", param="prompt")
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        room = self.check_room(prompt_len, max_tokens, param)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        params = SamplingParams(
            max_tokens=room if max_tokens is None else max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )
        try:
            params.validate(self.max_logprobs)
        except ValueError as exc:
            raise APIError(str(exc)) from None
        return params

    def make_request(self, base_id: str, index: int, prompt_ids: list[int], params, req) -> Request:
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise APIError(f"Token ids must be in [0, {vocab}).", param="prompt")
        rid = base_id if index == 0 else f"{base_id}-{index}"
        if self.engine.in_flight(rid):  # a client reusing an id: keep internal ids unique
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        return Request(
            rid,
            prompt_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            priority=req.priority,
            cache_salt=req.cache_salt,
        )

    # ---- running ----------------------------------------------------------------------
    async def run(self, requests: list[Request]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) from all requests of one API call as they arrive. The
        engine admits them all or none (503, nothing queued) before the first is awaited."""
        try:
            streams = self.engine.generate_all(requests)
        except EngineOverloaded as exc:
            raise APIError(str(exc), 503, headers={"Retry-After": "1"}) from None
        merged = self._merged(streams) if len(streams) > 1 else None
        try:
            if merged is None:
                async for out in streams[0]:
                    yield 0, out
            else:
                async for item in merged:
                    yield item
        finally:  # the streams' own ends abort theirs; release those never read
            await (merged.aclose() if merged is not None else streams[0].aclose())
            self.engine.release(requests)

    @staticmethod
    async def _merged(
        streams: list[AsyncGenerator[RequestOutput, None]],
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(stream index, output) of each stream's outputs, as they arrive, until all end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as exc:  # surfaced to the consumer, never swallowed
                await queue.put((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            done = 0
            while done < len(streams):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                done += item.finished
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def request_id(headers, body_id: str | None) -> str:
        """The body's id (checked as it was decoded), else X-Request-Id's, else a fresh one."""
        header = headers.get("X-Request-Id")
        check_request_id(header, header=True)  # a bad one is refused, even when unused
        return body_id or header or uuid.uuid4().hex

    @staticmethod
    def usage(choices: list[Choice]) -> dict:
        prompt = sum(len(c.prompt_ids) for c in choices)
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)},
        }

    @staticmethod
    def accumulate(choice: Choice, out: RequestOutput) -> None:
        choice.text += out.text
        choice.token_ids.extend(out.token_ids)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        choice.cached_tokens = out.num_cached_tokens
        if out.finished:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = out.stop_reason
            choice.error = out.error
            choice.kv_transfer_params = out.kv_transfer_params


def now_s() -> int:
    return int(time.time())
