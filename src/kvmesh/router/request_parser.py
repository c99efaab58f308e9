"""OpenAI request bodies to SchedulingRequests: the prompt's token ids and block keys, with a
large prompt tokenized on a thread so that answers in flight keep streaming meanwhile."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.router.plugins import SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.frontdoor import Request
    from kvmesh.router.tokens import PromptTokenizer

_ids = random.Random()  # request ids: seeded from the OS once, no system call per request
OFF_LOOP_BYTES = 64 * 1024  # bodies this large are tokenized on a thread, off the event loop


class ChatFields(msgspec.Struct):
    model: str | None = None
    prompt: Any = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None


_decoder = msgspec.json.Decoder(ChatFields)


class RequestParser:
    """Invariant: at most one thread at a time uses ``tokens`` (it is not thread-safe)."""

    def __init__(self, tokens: PromptTokenizer, tokenize: bool, block_size: int) -> None:
        self.tokens = tokens
        self.tokenize = tokenize  # False: no profile reads token ids, so none are computed
        self.block_size = block_size
        self._tokenizer_free = asyncio.Event()  # clear while a thread holds self.tokens
        self._tokenizer_free.set()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-tokenize")

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    async def parse(self, request: Request) -> SchedulingRequest:
        """scheduling_request, with a large prompt tokenized on a thread (its regex split and
        the Rust tokenizer release the GIL, so the event loop runs meanwhile). One thread at a
        time holds the tokenizer and its caches: requests that need it wait, requests in flight
        keep streaming."""
        if not self.tokenize:
            return self.scheduling_request(request.body, request.path, request.headers)
        while not self._tokenizer_free.is_set():
            await self._tokenizer_free.wait()
        if len(request.body) < OFF_LOOP_BYTES:
            return self.scheduling_request(request.body, request.path, request.headers)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(
            self._thread, self.scheduling_request, request.body, request.path, request.headers
        )
        self._tokenizer_free.clear()

        def released(f: asyncio.Future) -> None:
            self._tokenizer_free.set()
            if not f.cancelled():
                f.exception()  # retrieved here when the client left meanwhile

        work.add_done_callback(released)
        return await asyncio.shield(work)

    def scheduling_request(
        self, body: bytes, path: str, headers: dict[str, str]
    ) -> SchedulingRequest:
        """Headers with lower-case names, as the front door gives them."""
        fields = _decoder.decode(body)
        ids: list[int] = []
        if path.endswith("/chat/completions"):
            if not fields.messages:
                raise ValueError("messages must be a non-empty list")
            if self.tokenize:
                ids = self.tokens.encode_chat(
                    fields.messages,
                    tools=fields.tools,
                    add_generation_prompt=fields.add_generation_prompt,
                    **(fields.chat_template_kwargs or {}),
                )
        else:
            p = fields.prompt
            if isinstance(p, list) and p and isinstance(p[0], (str, list)):
                p = p[0]  # a batch: route by its first prompt
            if isinstance(p, str):
                if self.tokenize:
                    ids = self.tokens.encode_completion(p, fields.add_special_tokens)
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                ids = list(p)
            else:
                raise ValueError("prompt must be a string or a list of token ids")
        rid = headers.get("x-request-id") or f"{_ids.getrandbits(128):032x}"
        keys = self.tokens.block_keys(ids, cache_salt=fields.cache_salt) if self.tokenize else []
        return SchedulingRequest(rid, fields.model, ids, keys, headers, self.block_size)
