"""Chat rendering shared by the engine and the router, so that both make the same prompt text
(hence the same token ids) by construction.

Every template, the model's own included, is rendered by transformers' ``apply_chat_template``,
which compiles it in jinja2's ``ImmutableSandboxedEnvironment`` (checked once per tokenizer by
``sandboxed``: no attribute of Python internals, no mutation of the data it is given). A template
that comes with a request is refused unless the server trusts them
(``--trust-request-chat-template``, vLLM's flag and wording). A trusted request template still
renders on a thread of its own within ``REQUEST_TEMPLATE_SECONDS``: past that budget the request
gets a 400 and the thread is interrupted (an asynchronous exception, delivered at its next
bytecode), so a hostile template costs at most the budget in CPU and never holds an event loop.
Memory is not bounded within the budget (``{{ 'x' * 10**9 }}`` is one step): the opt-in trusts
the clients that far, as vLLM's does.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvmesh.protocol.openai import APIError

T = TypeVar("T")


class PromptError(APIError, ValueError):
    """A request whose prompt cannot be made: the client's error, a 400 (an APIError) that is
    also a ValueError, as malformed input is."""


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
REQUEST_TEMPLATE_SECONDS = 2.0  # a request's template renders within this, else 400
# a longer request template is refused (transformers keeps up to 128 compiled templates; the
# longest model templates are about 16 KiB)
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024
# apply_chat_template's own parameters: chat_template_kwargs reach the template, never these
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "sanitize_control_tokens",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# ImmutableSandboxedEnvironment refuses to call list.append; a plain environment renders it
_SANDBOX_PROBE = "{{ messages.append(0) }}"


def request_template(top_level: Any, template_kwargs: Any, trusted: bool) -> str | None:
    """The template a request brings, if any: vLLM's top-level ``chat_template`` field, else
    ``chat_template_kwargs["chat_template"]``. Without the server's opt-in: 400 naming the flag,
    in vLLM's words."""
    template = top_level
    if template is None and isinstance(template_kwargs, dict):
        template = template_kwargs.get("chat_template")
    if template is None:
        return None
    if not trusted:
        raise PromptError(UNTRUSTED_TEMPLATE, param="chat_template")
    if not isinstance(template, str):
        raise PromptError("chat_template must be a string.", param="chat_template")
    if len(template) > MAX_REQUEST_TEMPLATE_CHARS:
        raise PromptError(
            f"chat_template is longer than {MAX_REQUEST_TEMPLATE_CHARS} characters.",
            param="chat_template",
        )
    return template


def sandboxed(tokenizer: Any) -> bool:
    """Whether the tokenizer renders templates in an immutable sandbox (cached on it)."""
    verdict = getattr(tokenizer, "_kvmesh_sandboxed", None)
    if verdict is not None:
        return verdict
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ""}], tokenize=False, chat_template=_SANDBOX_PROBE
        )
        verdict = False
    except Exception as exc:
        verdict = type(exc).__name__ == "SecurityError"  # jinja2.exceptions.SecurityError
    with contextlib.suppress(AttributeError):
        tokenizer._kvmesh_sandboxed = verdict
    return verdict


def checked_template_kwargs(request_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs as they reach the template: without its own template
    (``request_template`` took it), and refused when they set apply_chat_template's own
    parameters."""
    if not request_kwargs:
        return {}
    kwargs = {k: v for k, v in request_kwargs.items() if k != "chat_template"}
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise PromptError(
            f"chat_template_kwargs may not set {', '.join(reserved)}.",
            param="chat_template_kwargs",
        )
    return kwargs


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template: str | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text of a chat (``messages`` as protocol.conversation shapes them), rendered by
    the model's template or by ``template`` (a request's, as ``request_template`` allowed it).
    The template's failures are the client's: 400, never a traceback."""
    kwargs = checked_template_kwargs(template_kwargs)
    if not sandboxed(tokenizer):
        raise APIError("Chat templates cannot be rendered in a sandbox on this server.", 500)

    def render() -> Any:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template,
            **kwargs,
        )

    try:
        text = render() if template is None else run_bounded(render, REQUEST_TEMPLATE_SECONDS)
    except APIError:
        raise
    except Exception as exc:  # jinja errors, sandbox refusals, bad roles: the client's input
        raise PromptError(f"Chat template could not be applied: {exc}", param="messages") from None
    if not isinstance(text, str):
        raise PromptError("The chat template did not render to text.", param="messages")
    return text


class _Interrupted(BaseException):
    """Raised inside a thread that ran past its budget (BaseException: jinja's and
    transformers' ``except Exception`` let it through)."""


def run_bounded(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` on a thread of its own; past ``seconds`` a 400, and the thread is interrupted.

    Invariant: the thread is only interrupted while ``finished`` is false (both under ``lock``),
    that is while it still runs ``fn`` or is about to record its result, never after."""
    lock = threading.Lock()
    finished = False
    outcome: list[tuple[Any, BaseException | None]] = []

    def work() -> None:
        nonlocal finished
        try:
            try:
                result: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:  # handed to the caller
                result = (None, exc)
            with lock:
                finished = True
            outcome.append(result)
        except _Interrupted:  # arrived after fn returned: nobody waits for this result
            pass

    thread = threading.Thread(target=work, name="kvmesh-chat-template", daemon=True)
    thread.start()
    thread.join(seconds)
    with lock:
        if not finished:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident or 0), ctypes.py_object(_Interrupted)
            )
            raise PromptError(
                f"The request's chat template did not render within {seconds:g} s.",
                param="chat_template",
            )
    thread.join()  # finished: only the append is left
    value, error = outcome[0]
    if error is not None:
        raise error
    return value
