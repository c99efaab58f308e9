"""Prompt preparation, one path for engine and router: an OpenAI completion or chat request body
becomes its prompt (``CompletionPrompt``, ``ChatPrompt``), checked by vLLM's rules in vLLM's
words, then its prompt text and token ids.

Both sides decode the same fields, with the same types, from the same bytes and call the same
functions in the same order, so the router keys exactly the token ids the engine computes, and
a request one refuses the other refuses with the same 400. The order of checks: the fields'
types (``decode_chat`` / ``decode_completion``), the request's own chat template
(``request_template``: trust, type, size), the prompt (``chat_prompt`` / ``completion_prompt``),
then rendering (``chat_text``). Encoding is each side's own, always equal to
``tokenizer.encode(text, add_special_tokens=...)``: the engine's verified Rust backend, the
router's cached fast path (checked against it on probes, and by tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from kvmesh.protocol.chat_template import PromptError, checked_template_kwargs, render_chat
from kvmesh.protocol.conversation import conversation, loops_over_content, template_source
from kvmesh.protocol.openai import APIError, completion_prompts, decode_request
from kvmesh.protocol.request_checks import (
    check_messages,
    check_request_id,
    check_response_format,
    check_tool_choice,
)

S = TypeVar("S", bound=msgspec.Struct)
Encoder = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> token ids

BOTH_GENERATION_FLAGS = (
    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
)
# transformers' words, which vLLM answers with when add_generation_prompt was left at its default
GENERATION_PROMPT_BY_DEFAULT = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a new "
    "assistant message instead."
)
EMPTY_MESSAGES = "messages must not be empty."


class PromptMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any] | str] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatFields(msgspec.Struct, kw_only=True):
    """The fields of a chat request (or of a /tokenize with messages) that make its prompt."""

    model: str | None = None
    request_id: str | None = None
    response_format: Any = None  # its type is checked (request_checks), nothing more
    tool_choice: str | dict[str, Any] | None = None
    messages: list[PromptMessage]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = None  # None: not sent, which means true
    continue_final_message: bool = False
    chat_template: Any = None  # Any: refused untrusted before its type is looked at
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # on top of the template's own (vLLM's default: none)
    cache_salt: str | None = None
    n: int = 1  # choices asked for (see check_choices)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # before max_tokens when both are given


class CompletionFields(msgspec.Struct, kw_only=True):
    """The fields of a completion request that make its prompts."""

    model: str | None = None
    request_id: str | None = None
    response_format: Any = None
    prompt: str | list[Any]
    add_special_tokens: bool = True
    cache_salt: str | None = None
    n: int = 1  # choices asked for of each prompt (see check_choices)
    max_tokens: int | None = 16


@dataclass(slots=True)
class ChatPrompt:
    """A checked chat prompt: what its template renders, and how the text is encoded."""

    messages: list[dict[str, Any]]  # as the template reads them (protocol.conversation)
    tools: list[dict[str, Any]] | None
    documents: list[dict[str, Any]] | None
    add_generation_prompt: bool  # never true together with continue_final_message
    continue_final_message: bool
    template: str | None  # the request's own, as request_template admitted it
    template_kwargs: dict[str, Any]  # reaching the template; none of apply_chat_template's own
    add_special_tokens: bool
    cache_salt: str | None
    chars: int  # about how long the rendered text will be


@dataclass(slots=True)
class CompletionPrompt:
    """A checked completion request's prompts, one per choice."""

    prompts: list[str | list[int]]  # text to encode, or token ids as given
    add_special_tokens: bool
    cache_salt: str | None


def _decode(body: bytes, cls: type[S]) -> S:
    """Decoded and checked (protocol.request_checks); PromptError."""
    try:
        fields = decode_request(body, cls)
        check_request_id(fields.request_id)
        check_response_format(fields.response_format)
        if isinstance(fields, ChatFields):
            check_messages(fields.messages)
            check_tool_choice(fields.tool_choice, fields.tools)
    except APIError as exc:
        raise PromptError(exc.message, exc.status, exc.param) from None
    return fields


def decode_chat(body: bytes) -> ChatFields:
    """A chat body's prompt fields (protocol.openai's size and depth limits): PromptError."""
    return _decode(body, ChatFields)


def decode_completion(body: bytes) -> CompletionFields:
    """A completion body's prompt fields: PromptError when mistyped."""
    return _decode(body, CompletionFields)


def chat_prompt(fields: ChatFields, tokenizer: Any, template: str | None) -> ChatPrompt:
    """The chat's prompt, checked as vLLM checks it; ``template`` is the request's own, as
    ``request_template`` admitted it. Raises PromptError, NonTextContent for non-text parts."""
    if not fields.messages:
        raise PromptError(EMPTY_MESSAGES, param="messages")
    generation_prompt = fields.add_generation_prompt
    if fields.continue_final_message and generation_prompt is not False:
        words = BOTH_GENERATION_FLAGS if generation_prompt else GENERATION_PROMPT_BY_DEFAULT
        raise PromptError(words, param="continue_final_message")
    kwargs = checked_template_kwargs(fields.chat_template_kwargs)
    wrap = loops_over_content(template_source(tokenizer, template, fields.tools))
    messages = conversation(fields.messages, wrap)
    chars = 4096 * len(fields.tools or ()) + sum(
        64 + (len(c) if isinstance(c := m["content"], str) else sum(len(p["text"]) for p in c))
        for m in messages
    )
    return ChatPrompt(
        messages,
        fields.tools,
        fields.documents,
        generation_prompt is not False,  # unset means true; false whenever continuing
        fields.continue_final_message,
        template,
        kwargs,
        fields.add_special_tokens,
        fields.cache_salt,
        chars,
    )


def completion_prompt(fields: CompletionFields) -> CompletionPrompt:
    """The request's prompts (a string, token ids, or a batch of either): PromptError."""
    try:
        prompts = completion_prompts(fields.prompt)
    except APIError as exc:
        raise PromptError(exc.message, exc.status, exc.param) from None
    return CompletionPrompt(prompts, fields.add_special_tokens, fields.cache_salt)


def prompt_count(prompt: str | list[Any]) -> int:
    """How many prompts a completion's ``prompt`` field holds, from its shape alone (a string
    or a list of token ids is one); ``completion_prompts`` checks their types."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def check_choices(fields: ChatFields | CompletionFields, limit: int) -> None:
    """A request's fan-out (its prompts times ``n``: the choices it would queue) past ``limit``:
    PromptError, before any prompt is tokenized or queued."""
    if isinstance(fields, ChatFields):
        prompts, asked = 1, fields.n
    else:
        prompts = prompt_count(fields.prompt)
        asked = prompts * fields.n
    if asked > limit:
        of = f"{prompts} prompts times n={fields.n}" if prompts > 1 else f"n={fields.n}"
        raise PromptError(
            f"This request asks for {asked} choices ({of}); at most {limit} are served per "
            "request. Split it into smaller requests.",
            param="prompt" if prompts > 1 else "n",
        )


def chat_text(tokenizer: Any, chat: ChatPrompt) -> str:
    """The chat's prompt text (protocol.chat_template: sandboxed, a request's own template on a
    thread of its own within its budget). Any thread may call it."""
    return render_chat(
        tokenizer,
        chat.messages,
        tools=chat.tools,
        documents=chat.documents,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        template=chat.template,
        template_kwargs=chat.template_kwargs,
    )


def prompt_token_ids(
    tokenizer: Any,
    prompt: ChatPrompt | CompletionPrompt,
    encode: Encoder | None = None,
    first_only: bool = False,
) -> list[list[int]]:
    """The token ids of each prompt (a chat has one; ``first_only``: the first of a batch), on
    the calling thread. ``encode`` must equal the tokenizer's own ``encode`` (the default)."""
    if encode is None:

        def encode(text: str, special: bool) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=special)

    special = prompt.add_special_tokens
    if isinstance(prompt, ChatPrompt):
        return [encode(chat_text(tokenizer, prompt), special)]
    prompts = prompt.prompts[:1] if first_only else prompt.prompts
    return [encode(p, special) if isinstance(p, str) else list(p) for p in prompts]
