"""OpenAI request bodies to SchedulingRequests: the prompt's token ids and block keys, with a
large prompt tokenized on a thread so that answers in flight keep streaming meanwhile, and a
request's own chat template refused unless trusted (--trust-request-chat-template)."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec

from kvmesh.protocol.chat_template import request_template
from kvmesh.protocol.openai import decode_request
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
    continue_final_message: bool = False
    chat_template: Any = None  # Any: refused untrusted before its type is looked at
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None


class RequestParser:
    """Invariant: at most one thread at a time uses ``tokens``' caches (they are not
    thread-safe); rendering a chat touches none of them."""

    def __init__(self, tokens: PromptTokenizer, tokenize: bool, block_size: int) -> None:
        self.tokens = tokens
        self.tokenize = tokenize  # False: no profile reads token ids, so none are computed
        self.block_size = block_size
        self.trust_request_chat_template = False  # Router sets it from its config
        self._tokenizer_free = asyncio.Event()  # clear while a thread holds self.tokens
        self._tokenizer_free.set()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-tokenize")

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    async def parse(self, request: Request) -> SchedulingRequest:
        """scheduling_request, with a large prompt tokenized on a thread (its regex split and
        the Rust tokenizer release the GIL, so the event loop runs meanwhile), and a request's
        own chat template rendered on a thread of its own within its budget. One thread at a
        time holds the tokenizer and its caches: requests that need it wait, requests in flight
        keep streaming."""
        fields, chat, template = self.fields(request.body, request.path)
        if not self.tokenize:
            return self.build(fields, chat, None, request.headers)
        text = None
        if template is not None:
            text = await asyncio.to_thread(self.render, fields, template)
        while not self._tokenizer_free.is_set():
            await self._tokenizer_free.wait()
        if max(len(request.body), len(text or "")) < OFF_LOOP_BYTES:
            return self.build(fields, chat, text, request.headers)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._thread, self.build, fields, chat, text, request.headers)
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
        fields, chat, template = self.fields(body, path)
        text = None
        if template is not None and self.tokenize:
            text = self.render(fields, template)
        return self.build(fields, chat, text, headers)

    def fields(self, body: bytes, path: str) -> tuple[ChatFields, bool, str | None]:
        """The body's fields (protocol.openai's size and depth limits: APIError), whether it is
        a chat, and the chat's own template (refused unless the router trusts them)."""
        fields = decode_request(body, ChatFields)
        chat = path.endswith("/chat/completions")
        if not chat:
            return fields, False, None
        if not fields.messages:
            raise ValueError("messages must be a non-empty list")
        trusted = self.trust_request_chat_template
        template = request_template(fields.chat_template, fields.chat_template_kwargs, trusted)
        return fields, True, template

    def render(self, fields: ChatFields, template: str | None) -> str:
        """The chat's prompt text (any thread: no tokenizer cache is touched)."""
        return self.tokens.render_chat(
            fields.messages or [],
            fields.tools,
            fields.add_generation_prompt,
            fields.continue_final_message,
            template,
            fields.chat_template_kwargs,
        )

    def build(
        self, fields: ChatFields, chat: bool, text: str | None, headers: dict[str, str]
    ) -> SchedulingRequest:
        """Token ids (when the pipeline reads them) and block keys; ``text``: the chat already
        rendered (else rendered here)."""
        ids: list[int] = []
        if chat:
            if self.tokenize:
                text = self.render(fields, None) if text is None else text
                ids = self.tokens.encode_text(text)
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
