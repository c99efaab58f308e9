"""Checks of an OpenAI request's fields that engine and router make alike, as vLLM makes them
(protocol.prompt calls them as it decodes a body): request ids fit for headers and logs, known
message roles, a bounded message count, a `tool_choice` that names a given tool, a known
`response_format` type. Each failure is a 400 (APIError) naming the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.protocol.openai import APIError

MAX_REQUEST_ID_CHARS = 512  # a request id (body `request_id` or X-Request-Id) longer: 400
ID_HEADER_CHARS = "X-Request-Id must be printable ASCII"
ID_CHARS = "request_id may not hold control or separator characters (CR, LF, NUL, ...)"


def request_id_problem(value: str, header: bool = False) -> str | None:
    """Why a client's request id cannot be used, or None. Ids end up in response headers and
    log lines: no control or line-separator characters, at most MAX_REQUEST_ID_CHARS; one that
    came in a header must be printable ASCII (a header cannot carry other text faithfully)."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        return f"The request id is longer than {MAX_REQUEST_ID_CHARS} characters."
    if header:
        return None if value.isascii() and value.isprintable() else f"{ID_HEADER_CHARS}."
    return None if value.isprintable() else f"{ID_CHARS}."


def check_request_id(value: str | None, header: bool = False) -> None:
    """APIError (400) unless ``value`` is None or a usable request id (request_id_problem)."""
    if value is not None and (problem := request_id_problem(value, header)) is not None:
        raise APIError(problem, param="X-Request-Id" if header else "request_id")


def request_id_headers(request_id: str) -> dict[str, str]:
    """The X-Request-Id response header naming a request; none for an id no header can carry
    as is (non-ASCII: the body's `id` still names it in full)."""
    return {"X-Request-Id": request_id} if request_id.isascii() else {}


# as vLLM's chat messages (OpenAI's, plus Llama's "ipython" tool results)
ROLES = frozenset(("system", "developer", "user", "assistant", "tool", "function", "ipython"))
# messages in one chat request: far past any real conversation that fits a context (OpenAI
# allows 2,048); bounds the work a request can ask for before its length is known
MAX_CHAT_MESSAGES = 16_384
TOOL_CHOICES = ("none", "auto", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")  # vLLM's


def check_messages(messages: Sequence[Any]) -> None:
    """A chat's message count and roles (objects with a ``role``)."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise APIError(
            f"A chat request may hold at most {MAX_CHAT_MESSAGES} messages; it has "
            f"{len(messages)}.",
            param="messages",
        )
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise APIError(
                f"messages[{i}].role must be one of: {', '.join(sorted(ROLES))}.",
                param="messages",
            )


def check_tool_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> None:
    """`tool_choice` as vLLM checks it: a known mode, and a named function among `tools`."""
    if tool_choice is None or tool_choice == "none":
        return
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise APIError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, or name a function.",
                param="tool_choice",
            )
        if tool_choice == "required" and not tools:
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(
            'tool_choice must be {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    names = {
        t["function"].get("name")
        for t in tools or ()
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
    }
    if name not in names:
        raise APIError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`.",
            param="tool_choice",
        )


def check_response_format(response_format: Any) -> None:
    if response_format is None:
        return
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise APIError(
            f"response_format.type must be one of: {', '.join(RESPONSE_FORMATS)}.",
            param="response_format",
        )
