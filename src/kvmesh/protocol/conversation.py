"""OpenAI chat messages as chat templates read them, shaped as vLLM shapes them before it applies
a template (its ``parse_chat_messages``), for engine and router alike.

- content: text parts (``text``, ``input_text``, ``output_text``; ``refusal``; a bare string)
  become their texts joined by "\\n" for a template that reads content as a string, or
  ``{"type": "text", "text": ...}`` parts for one that loops over it (the template's *content
  format*, detected from its syntax tree as vLLM does). A string content is one text part; no
  content is no part ("" or []).
  Another part (an image, audio) raises ``NonTextContent``: the text-only engine refuses it, the
  router routes it without prefix keys.
- a tool message's text parts are always one string; its ``tool_call_id`` is kept.
- an assistant message keeps ``tool_calls`` (none when empty), each call's JSON ``arguments``
  decoded to the object templates expect (``{}`` when missing, malformed or not an object), and
  its ``reasoning`` (also as ``reasoning_content``).
- ``name`` is kept when given; nothing else is passed on.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from kvmesh.protocol.chat_template import PromptError

# part type -> the key holding its text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class NonTextContent(PromptError):
    """A message holds a part that is not text."""

    def __init__(self) -> None:
        super().__init__("Only text content parts are supported.", param="messages")


def conversation(messages: Iterable[Any], loops_over_content: bool) -> list[dict[str, Any]]:
    """``messages`` (objects with role, content, name, tool_calls, tool_call_id, reasoning)
    as dicts for the template; ``loops_over_content``: the template's content format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        wrap = loops_over_content and m.role != "tool"
        item: dict[str, Any] = {"role": m.role, "content": _content(m.content, wrap)}
        if m.role == "assistant":
            if m.tool_calls:
                item["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
            reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
            if reasoning is not None:
                item["reasoning"] = item["reasoning_content"] = reasoning
        elif m.role == "tool" and m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


def _content(content: str | list[dict[str, Any] | str] | None, wrap: bool) -> str | list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if wrap else content
    texts = []
    for part in content or ():
        if isinstance(part, str):  # a bare string part is text (vLLM takes it too)
            texts.append(part)
            continue
        kind = part.get("type")
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise NonTextContent()
        text = part.get(key)
        if text is None:  # vLLM skips a text part without text
            continue
        if not isinstance(text, str):
            raise PromptError(f"A content part's {key} must be a string.", param="messages")
        texts.append(text)
    return [{"type": "text", "text": t} for t in texts] if wrap else "\n".join(texts)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A copy of an assistant's tool call with its arguments as an object (vLLM's rules)."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise PromptError(
            "chat completions only support assistant tool_calls of type 'function'.",
            param="tool_calls",
        )
    args = function.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:  # kept in the history: failing it would fail every later turn
            args = None
    return {**call, "function": {**function, "arguments": args if isinstance(args, dict) else {}}}


# ---- content format: does the template loop over a message's content? ----------------------
class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` blocks (no output)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


_PARSER = jinja2.sandbox.ImmutableSandboxedEnvironment(
    extensions=[_GenerationTag, jinja2.ext.loopcontrols]
)


def template_source(tokenizer: Any, template: str | None, tools: Any) -> str | None:
    """The template text that will render: the request's, else the tokenizer's (for tools, its
    tool-use template when it has one); None when there is none."""
    try:
        return tokenizer.get_chat_template(template, tools=tools)
    except Exception:  # no template: rendering will say so
        return template


@functools.lru_cache(maxsize=64)
def loops_over_content(source: str | None) -> bool:
    """Whether the template iterates over some message's content (vLLM's "openai" content
    format) rather than reading it as one string ("string", also when the source is unreadable).
    A message is an item of a loop over ``messages`` or over a variable set from it."""
    if source is None:
        return False
    try:
        tree = _PARSER.parse(source)
    except jinja2.TemplateError:
        return False
    lists = set(_aliases(tree, "messages"))
    items = {
        loop.target.name
        for loop in tree.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, lists, None)
    }
    return any(_reads(loop.iter, items, "content") for loop in tree.find_all(jinja2.nodes.For))


def _reads(node: jinja2.nodes.Node, names: set[str], key: str | None) -> bool:
    """Whether ``node`` is one of ``names`` (``key``: its item ``key``), maybe filtered, tested
    or sliced."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
        isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
    ):
        if node.node is None:
            return False
        node = node.node
    if key is not None:
        if isinstance(node, jinja2.nodes.Getitem):
            if not (isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key):
                return False
        elif not (isinstance(node, jinja2.nodes.Getattr) and node.attr == key):
            return False
        node = node.node
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names


def _aliases(tree: jinja2.nodes.Template, root: str) -> Iterator[str]:
    """``root`` and every variable set from it, or from such a variable, maybe filtered."""
    seen, todo = {root}, [root]
    yield root
    while todo:
        name = todo.pop()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in seen
                and _reads(assign.node, {name}, None)
            ):
                seen.add(target.name)
                todo.append(target.name)
                yield target.name
