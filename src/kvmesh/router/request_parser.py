"""OpenAI request bodies to SchedulingRequests: the prompt's token ids and block keys, with a
large prompt tokenized on a thread so that answers in flight keep streaming meanwhile, and a
request's own chat template refused unless trusted (--trust-request-chat-template).

The prompt is protocol.prompt's, as the engine makes it: the same fields decoded from the same
bytes, the same checks in the same order (a bad request gets the engine's 400, in its words),
the same rendering; only the encoding is the router's own cached one, equal to the tokenizer's.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvmesh.protocol.chat_template import request_template
from kvmesh.protocol.conversation import NonTextContent
from kvmesh.protocol.prompt import (
    ChatFields,
    ChatPrompt,
    CompletionFields,
    CompletionPrompt,
    chat_prompt,
    chat_text,
    completion_prompt,
    decode_chat,
    decode_completion,
    prompt_token_ids,
)
from kvmesh.protocol.request_checks import check_request_id
from kvmesh.router.plugins import SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.frontdoor import Request
    from kvmesh.router.tokens import PromptTokenizer

_ids = random.Random()  # request ids: seeded from the OS once, no system call per request
OFF_LOOP_BYTES = 64 * 1024  # bodies this large are tokenized on a thread, off the event loop


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

    def set_block_size(self, block_size: int) -> None:
        """Requests are keyed and sized in ``block_size``-token blocks from now on. A request
        being keyed on the tokenizer thread meanwhile may keep the old size: one request."""
        self.tokens.set_block_size(block_size)
        self.block_size = block_size

    def close(self) -> None:
        self._thread.shutdown(wait=False)

    def settle(self) -> None:
        """Apply the tokenizer's deferred cache entries, unless a thread holds it (its next
        call applies them then)."""
        if self._tokenizer_free.is_set():
            self.tokens.settle()

    async def parse(self, request: Request) -> SchedulingRequest:
        """scheduling_request, with a large prompt tokenized on a thread (its regex split and
        the Rust tokenizer release the GIL, so the event loop runs meanwhile), and a request's
        own chat template rendered on a thread of its own within its budget. One thread at a
        time holds the tokenizer and its caches: requests that need it wait, requests in flight
        keep streaming."""
        fields, prompt = self.fields(request.body, request.path)
        if prompt is None:
            return self.build(fields, None, None, request.headers)
        text = None
        if isinstance(prompt, ChatPrompt) and prompt.template is not None:
            text = await asyncio.to_thread(chat_text, self.tokens.tokenizer, prompt)
        while not self._tokenizer_free.is_set():
            await self._tokenizer_free.wait()
        if max(len(request.body), len(text or "")) < OFF_LOOP_BYTES:
            return self.build(fields, prompt, text, request.headers)
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._thread, self.build, fields, prompt, text, request.headers)
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
        fields, prompt = self.fields(body, path)
        text = None
        if isinstance(prompt, ChatPrompt) and prompt.template is not None:
            text = chat_text(self.tokens.tokenizer, prompt)
        return self.build(fields, prompt, text, headers)

    def fields(
        self, body: bytes, path: str
    ) -> tuple[ChatFields | CompletionFields, ChatPrompt | CompletionPrompt | None]:
        """The body's prompt fields and, when token ids are wanted, its prompt, checked
        (PromptError: the engine's 400). A chat's own template is refused unless the router
        trusts them; a chat with non-text content gets no prompt (no keys): its engine (a
        multimodal vLLM, say) decides what it is."""
        if not path.endswith("/chat/completions"):
            completion = decode_completion(body)
            return completion, completion_prompt(completion) if self.tokenize else None
        fields = decode_chat(body)
        trusted = self.trust_request_chat_template
        template = request_template(fields.chat_template, fields.chat_template_kwargs, trusted)
        if not self.tokenize:
            return fields, None
        try:
            return fields, chat_prompt(fields, self.tokens.tokenizer, template)
        except NonTextContent:
            return fields, None

    def build(
        self,
        fields: ChatFields | CompletionFields,
        prompt: ChatPrompt | CompletionPrompt | None,
        text: str | None,
        headers: dict[str, str],
    ) -> SchedulingRequest:
        """Token ids of the (first) prompt and their block keys (shared with earlier requests
        of the same prompt text: read-only); ``text``: the chat already rendered (else rendered
        here)."""
        ids: Sequence[int] = []
        keys: list[int] = []
        tokens, salt = self.tokens, fields.cache_salt
        if isinstance(prompt, ChatPrompt):
            if text is None:
                text = chat_text(tokens.tokenizer, prompt)
            ids, keys = tokens.ids_and_keys(text, prompt.add_special_tokens, salt)
        elif prompt is not None:
            first = prompt.prompts[0] if prompt.prompts else None
            if isinstance(first, str):
                ids, keys = tokens.ids_and_keys(first, prompt.add_special_tokens, salt)
            else:  # token ids as given
                ids = prompt_token_ids(tokens.tokenizer, prompt, first_only=True)[0]
                keys = tokens.block_keys(ids, cache_salt=salt) if ids else []
        rid = headers.get("x-request-id")
        check_request_id(rid, header=True)  # it goes into the endpoint's head and our logs
        rid = rid or f"{_ids.getrandbits(128):032x}"
        return SchedulingRequest(rid, fields.model, ids, keys, headers, self.block_size)
