"""OpenAI-compatible request schemas (with vLLM's extras), error bodies and SSE framing."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # as vLLM's
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    user: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a batch of either (see `prompts`)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completion request: str, list[int], list[str] or list[list[int]]."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    out: list[str | list[int]] = []
    for p in prompt:
        if isinstance(p, str) or isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            out.append(p)
        else:
            raise APIError(
                "prompt must be a string, a list of token ids, or a list of either.", param="prompt"
            )
    if not out:
        raise APIError("The prompt is empty.", param="prompt")
    return out


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class APIError(Exception):
    """An error with an HTTP status that reaches the client as an OpenAI error body."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        413: "RequestEntityTooLarge",
        405: "MethodNotAllowed",
        408: "RequestTimeoutError",
        415: "UnsupportedMediaTypeError",
        417: "ExpectationFailedError",
        429: "RateLimitError",
        431: "RequestHeaderFieldsTooLargeError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
        505: "HTTPVersionNotSupportedError",
    }

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": APIError.TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def context_length_error(
    max_model_len: int, prompt_tokens: int, completion_tokens: int, param: str, at_least: bool
) -> APIError:
    """vLLM's words for a prompt (plus the completion asked for) past the context length;
    ``at_least``: the prompt's count is a lower bound, from its length in characters."""
    some = "at least " if at_least else ""
    return APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {some}{prompt_tokens + completion_tokens} tokens ({some}{prompt_tokens} in "
        f"the messages, {completion_tokens} in the completion). Please reduce the length of the "
        "messages or completion.",
        param=param,
    )


MAX_JSON_DEPTH = 64  # arrays and objects nested deeper than this in a request body: 400
TOO_DEEP = f"The request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)."
# a body's bytes that matter to its depth: quotes (strings' edges) and brackets, with their steps
_NOT_MARKS = bytes(sorted(set(range(256)) - set(b'"[]{}')))
_STEP = np.zeros(256, dtype=np.int32)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_decoders: dict[type, msgspec.json.Decoder] = {}
_encoder = msgspec.json.Encoder()


def opening_brackets(body: bytes) -> int:
    """``body.count(b"{") + body.count(b"[")``; past 2 KiB in one vector pass: "[" (0x5B) and
    "{" (0x7B) are the bytes that read 0x7B with bit 0x20 set (bytes.count is a byte-at-a-time
    loop: two of them were an eighth of the router's instructions on a new 8k prompt, while
    numpy's fixed cost per call outweighs them on a small body)."""
    if len(body) < 2048:
        return body.count(b"{") + body.count(b"[")
    return int(np.count_nonzero((np.frombuffer(body, dtype=np.uint8) | 0x20) == 0x7B))


def nested_too_deeply(body: bytes, levels: int = MAX_JSON_DEPTH) -> bool:
    """Whether a well-formed JSON text nests more than ``levels`` arrays and objects, fields
    no schema reads included; vector passes over the bytes, milliseconds for megabytes (a
    regex that cut the strings out held the event loop 0.2 s on 100,000 small messages).
    Escapes go first (escaped backslashes, then escaped quotes: JSON reads them left to
    right), so every quote left opens or closes a string; a bracket counts where an even
    number of quotes precedes it."""
    if opening_brackets(body) <= levels:  # most bodies: too few brackets to nest that deep
        return False
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = np.frombuffer(text.translate(None, _NOT_MARKS), dtype=np.uint8)
    # quotes so far, mod 256 (the parity survives the wrap): even outside strings
    outside = (np.cumsum(marks == ord('"'), dtype=np.uint8) & 1) == 0
    depth = np.cumsum(np.where(outside, _STEP[marks], 0), dtype=np.int32)
    return bool(depth.size) and int(depth.max()) > levels


def decode_request(body: bytes, cls: type[msgspec.Struct]):
    """Parse and type-check a JSON body; any problem becomes a 400 naming the field, and a
    body nested more than MAX_JSON_DEPTH deep a 400 too (msgspec itself stops at Python's
    recursion limit with a RecursionError)."""
    decoder = _decoders.get(cls)
    if decoder is None:
        decoder = _decoders[cls] = msgspec.json.Decoder(cls)
    if not body:
        raise APIError("The request body is empty; expected a JSON object.")
    try:
        value = decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise APIError(f"Invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise APIError(f"Malformed JSON in request body: {exc}") from None
    except RecursionError:
        raise APIError(TOO_DEEP) from None
    if nested_too_deeply(body):  # unknown fields too, which the schema skipped
        raise APIError(TOO_DEEP)
    return value


def encode_json(obj: Any) -> bytes:
    return _encoder.encode(obj)


def sse_event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
