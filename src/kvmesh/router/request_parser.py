"""OpenAI request bodies to SchedulingRequests: the prompt's token ids and block keys, with a
request's own chat template refused unless trusted (--trust-request-chat-template), and each
request's work bounded, none waiting behind another's: a request asking for more choices than
--max-choices-per-request, or whose prompt no endpoint's context can hold (a lower bound on its
tokens from its length), is refused before its prompt is tokenized; a long prompt is tokenized
on a thread, and a short one passes it.

The prompt is protocol.prompt's, as the engine makes it: the same fields decoded from the same
bytes, the same checks in the same order (a bad request gets the engine's 400, in its words),
the same rendering; only the encoding is the router's own cached one, equal to the tokenizer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvmesh.protocol.chat_template import request_template
from kvmesh.protocol.conversation import NonTextContent
from kvmesh.protocol.openai import context_length_error
from kvmesh.protocol.prompt import (
    ChatFields,
    ChatPrompt,
    CompletionFields,
    CompletionPrompt,
    chat_prompt,
    chat_text,
    check_choices,
    completion_prompt,
    decode_chat,
    decode_completion,
    prompt_token_ids,
)
from kvmesh.protocol.request_checks import check_request_id
from kvmesh.protocol.tokenizer import min_tokens, token_span
from kvmesh.router.plugins import SchedulingRequest

if TYPE_CHECKING:
    from kvmesh.router.request_reader import Request
    from kvmesh.router.tokens import PromptTokenizer

_ids = random.Random()  # request ids: seeded from the OS once, no system call per request
OFF_LOOP_BYTES = 64 * 1024  # bodies this large are tokenized on a thread, off the event loop


class RequestParser:
    """Invariant: at most one thread at a time uses ``tokens``' caches (they are not
    thread-safe); rendering a chat, and ``tokens``' uncached encoding, touch none of them."""

    def __init__(self, tokens: PromptTokenizer, tokenize: bool, block_size: int) -> None:
        self.tokens = tokens
        self.tokenize = tokenize  # False: no profile reads token ids, so none are computed
        self.block_size = block_size
        # the length bound's facts, read from the whole vocabulary once, now: the first long
        # prompt's check_fits, on the event loop, had read them (0.9 s on a loaded host)
        token_span(tokens.tokenizer)
        self.trust_request_chat_template = False  # Router sets it from its config
        self.max_choices_per_request = 256  # Router sets it from its config
        # the largest context among the endpoints (None: not known); Router sets it
        self.context_limit: Callable[[], int | None] = lambda: None
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
        """scheduling_request, bounded: a long prompt (OFF_LOOP_BYTES) is first checked to fit
        the largest context (``check_fits``: no tokenizing), then tokenized on the tokenizer
        thread, which holds ``tokens`` and its caches (its regex split and the Rust tokenizer
        release the GIL, so the event loop runs meanwhile); long prompts take turns on it. A
        short prompt is tokenized on the loop, with the caches when the thread is free, else
        whole without them: it never waits for a long one. A long chat, or one with its own
        template (within its budget), is rendered on a thread of its own first."""
        fields, prompt = self.fields(request.body, request.path)
        headers = request.headers
        if prompt is None:
            return self.build(fields, None, None, headers)
        long = len(request.body) >= OFF_LOOP_BYTES
        text = None
        if isinstance(prompt, ChatPrompt) and (long or prompt.template is not None):
            text = await asyncio.to_thread(chat_text, self.tokens.tokenizer, prompt)
            long = long or len(text) >= OFF_LOOP_BYTES
        free = self._tokenizer_free
        if not long:
            return self.build(fields, prompt, text, headers, cached=free.is_set())
        self.check_fits(fields, prompt, text)
        while not free.is_set():
            await free.wait()
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self._thread, self.build, fields, prompt, text, headers)
        free.clear()

        def released(f: asyncio.Future) -> None:
            free.set()
            if not f.cancelled():
                f.exception()  # retrieved here when the client left meanwhile

        work.add_done_callback(released)
        return await asyncio.shield(work)

    def check_fits(
        self,
        fields: ChatFields | CompletionFields,
        prompt: ChatPrompt | CompletionPrompt,
        text: str | None,
    ) -> None:
        """The 400 an engine gives a prompt (plus the completion asked for) past its context,
        in vLLM's words, when even the largest context among the endpoints cannot hold it by a
        lower bound on its tokens from its length (protocol.tokenizer.min_tokens, C-speed): the
        prompt is never tokenized. Only the prompt the router tokenizes (a chat's, or a batch's
        first) is checked; the engine checks the others."""
        limit = self.context_limit()
        if limit is None:
            return
        if isinstance(prompt, ChatPrompt):
            assert isinstance(fields, ChatFields) and text is not None
            asked = fields.max_completion_tokens or fields.max_tokens
            param, first = "messages", text
        else:
            assert isinstance(fields, CompletionFields)
            asked, param = fields.max_tokens, "prompt"
            first = prompt.prompts[0] if prompt.prompts else ""
        bound = isinstance(first, str)
        least = min_tokens(self.tokens.tokenizer, first) if bound else len(first)
        room = limit - least
        if least and (room <= 0 or (asked is not None and asked > room)):
            raise context_length_error(limit, least, asked or 0, param, bound)

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
        multimodal vLLM, say) decides what it is. More choices than max_choices_per_request
        (prompts times n): PromptError, before any prompt is tokenized."""
        limit = self.max_choices_per_request
        if not path.endswith("/chat/completions"):
            completion = decode_completion(body)
            prompt = completion_prompt(completion) if self.tokenize else None
            check_choices(completion, limit)
            return completion, prompt
        fields = decode_chat(body)
        trusted = self.trust_request_chat_template
        template = request_template(fields.chat_template, fields.chat_template_kwargs, trusted)
        chat = None
        if self.tokenize:
            with contextlib.suppress(NonTextContent):
                chat = chat_prompt(fields, self.tokens.tokenizer, template)
        check_choices(fields, limit)
        return fields, chat

    def build(
        self,
        fields: ChatFields | CompletionFields,
        prompt: ChatPrompt | CompletionPrompt | None,
        text: str | None,
        headers: dict[str, str],
        cached: bool = True,
    ) -> SchedulingRequest:
        """Token ids of the (first) prompt and their block keys (shared with earlier requests
        of the same prompt text: read-only); ``text``: the chat already rendered (else rendered
        here); ``cached`` False: computed without the tokenizer's caches (a thread holds
        them)."""
        rid = headers.get("x-request-id")
        check_request_id(rid, header=True)  # it goes into the endpoint's head and our logs
        ids: Sequence[int] = []
        keys: list[int] = []
        tokens, salt = self.tokens, fields.cache_salt
        encode = tokens.ids_and_keys if cached else tokens.uncached_ids_and_keys
        if isinstance(prompt, ChatPrompt):
            if text is None:
                text = chat_text(tokens.tokenizer, prompt)
            ids, keys = encode(text, prompt.add_special_tokens, salt)
        elif prompt is not None:
            first = prompt.prompts[0] if prompt.prompts else None
            if isinstance(first, str):
                ids, keys = encode(first, prompt.add_special_tokens, salt)
            else:  # token ids as given
                ids = prompt_token_ids(tokens.tokenizer, prompt, first_only=True)[0]
                key = tokens.block_keys if cached else tokens.uncached_block_keys
                keys = key(ids, salt) if ids else []
        rid = rid or f"{_ids.getrandbits(128):032x}"
        return SchedulingRequest(rid, fields.model, ids, keys, headers, self.block_size)
