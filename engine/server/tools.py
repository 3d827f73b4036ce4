"""Tool calling on /v1/chat/completions, as vLLM serves it for Qwen3 (its Hermes parser):
`tools` go to the chat template, the answer's `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` blocks become `tool_calls` (ids `chatcmpl-tool-...`). tool_choice `required`
and a named function are enforced with guided decoding (a JSON schema built from the tools,
as vLLM builds it): a named call's output is its arguments, a required one a JSON array of
{"name", "parameters"}. Pure functions and per-choice state; no I/O."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pdpool.engine.structured.spec import GuidedSpec, json_schema_spec
from pdpool.protocol import ChatMessageFields, RequestError, ToolCallFields

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def tool_call_id() -> str:
    """vLLM's: 16 hex digits of a random UUID."""
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {...}}]
    choice: Any  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel: Optional[bool]

    @property
    def named(self) -> Optional[str]:
        return self.choice["function"]["name"] if isinstance(self.choice, dict) else None

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object", "properties": {}}
        raise RequestError(f"tool_choice names '{name}', which is not in tools", "tool_choice")


def tool_request_of(extras: dict[str, Any]) -> Optional[ToolRequest]:
    """The body's tools (None without any); RequestError naming what is wrong."""
    tools, choice = extras.get("tools"), extras.get("tool_choice")
    parallel = extras.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError("when using `tool_choice`, `tools` must be set", "tool_choice")
        return None
    check_tools(tools)
    choice = "auto" if choice is None else choice
    if not (choice in ("none", "auto", "required") or _is_named_choice(choice)):
        raise RequestError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    req = ToolRequest(tools, choice, parallel)
    if req.named:
        req.parameters(req.named)
    return req


def check_tools(tools: Any) -> None:
    """RequestError unless `tools` is a list of function tools (what the template reads)."""
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        raise RequestError(
            "tools must be a list of {'type': 'function', 'function': {'name': ...}}", "tools"
        )


def _is_function_tool(tool: Any) -> bool:
    if not isinstance(tool, dict):
        return False
    fn = tool.get("function")
    return (
        tool.get("type", "function") == "function"
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and isinstance(fn.get("parameters", {}), (dict, type(None)))
    )


def _is_named_choice(choice: Any) -> bool:
    fn = choice.get("function") if isinstance(choice, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str)


def forced_spec(req: Optional[ToolRequest]) -> Optional[GuidedSpec]:
    """The guided-decoding schema a tool_choice implies (vLLM's get_json_schema_from_tools)."""
    if req is None or req.choice in ("none", "auto"):
        return None
    # Compact JSON (no free whitespace): unlike vLLM, so that a weak model cannot wander in
    # blanks until max_tokens and leave arguments that do not parse.
    if req.named:
        return json_schema_spec(req.parameters(req.named), compact=True)
    items = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": req.parameters(t["function"]["name"]),
            },
            "required": ["name", "parameters"],
        }
        for t in req.tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if req.parallel is False:
        schema["maxItems"] = 1
    return json_schema_spec(schema, compact=True)


def template_messages(messages: list[ChatMessageFields], text_of: Any) -> list[dict[str, Any]]:
    """Chat messages as the template reads them: assistant `tool_calls` (arguments as
    objects, as Qwen3's template renders them) and a tool message's `tool_call_id`."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": text_of(m)}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_call(call: ToolCallFields) -> dict[str, Any]:
    args = call.function.arguments
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise RequestError("messages: tool call arguments must be JSON", "messages") from None
    return {
        **call.model_dump(exclude_unset=True),
        "function": {"name": call.function.name, "arguments": args},
    }


# --- the answer ---------------------------------------------------------------------------
def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_calls(text: str, req: ToolRequest) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(content, tool_calls) of a whole answer."""
    calls: list[dict[str, Any]] = []
    content: Optional[str] = text
    if req.named:
        calls, content = [_call(req.named, text)], ""
    elif req.choice == "required":
        calls = _required_calls(text)
        content = "" if calls else text  # cut by max_tokens: the text is the answer
    elif req.choice == "auto" and START in text:
        try:
            found = [json.loads(a or b) for a, b in _CALL.findall(text)]
            calls = [
                _call(f["name"], json.dumps(f["arguments"], ensure_ascii=False)) for f in found
            ]
            content = text[: text.find(START)] or None
        except (ValueError, KeyError, TypeError):
            calls = []
    if req.parallel is False:
        calls = calls[:1]
    return content, calls


def _required_calls(text: str) -> list[dict[str, Any]]:
    """The calls of tool_choice required's JSON array; [] when it does not parse."""
    try:
        items = json.loads(text)
        return [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
    except (ValueError, KeyError, TypeError):
        return []


def finish_reason(req: ToolRequest, calls: list[Any], reason: Optional[str]) -> Any:
    """vLLM's: "tool_calls" when auto called a tool or required stopped; named keeps its own
    (OpenAI's "stop"). Never "tool_calls" without calls: a client that trusts it reads them."""
    if reason is None or not calls:
        return reason
    if req.choice == "auto" or (req.choice == "required" and reason == "stop"):
        return "tool_calls"
    return reason


@dataclass
class ToolStream:
    """One streamed choice: its text so far and what of its tool calls was sent; each
    `delta` re-reads the whole text (as vLLM's Hermes parser) and sends the difference."""

    req: ToolRequest
    text: str = ""
    sent_content: int = 0
    names: list[str] = field(default_factory=list)
    args_sent: list[str] = field(default_factory=list)

    def delta(self, new_text: str, finished: bool) -> dict[str, Any]:
        self.text += new_text
        if self.req.named:
            return self._named(new_text)
        if self.req.choice == "required":
            return self._whole_calls(finished)
        return self._hermes(finished)

    def _named(self, new_text: str) -> dict[str, Any]:
        if not new_text:
            return {}
        if not self.names:
            self.names.append(self.req.named or "")
            call = _call(self.req.named or "", new_text)
            return {"tool_calls": [{"index": 0, **call}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]}

    def _whole_calls(self, finished: bool) -> dict[str, Any]:
        """required: each call is sent whole once the array is complete; an array that does
        not parse (cut by max_tokens) is sent as content, as the whole answer's."""
        if not finished:
            return {}
        content, calls = parse_calls(self.text, self.req)
        if not calls:
            return {"content": content} if content else {}
        self.names = [c["function"]["name"] for c in calls]
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}

    def _hermes(self, finished: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        start = self.text.find(START)
        plain_end = start if start >= 0 else len(self.text) - _partial_overlap(self.text, START)
        if finished and start < 0:
            plain_end = len(self.text)
        if plain_end > self.sent_content:
            out["content"] = self.text[self.sent_content : plain_end]
            self.sent_content = plain_end
        deltas = self._call_deltas(start) if start >= 0 else []
        if deltas:
            out["tool_calls"] = deltas
        return out

    def _call_deltas(self, start: int) -> list[dict[str, Any]]:
        deltas = []
        for i, (body, complete) in enumerate(_call_bodies(self.text[start:])):
            if i == len(self.names):
                name = re.search(r'"name"\s*:\s*"([^"]+)"', body)
                if name is None:
                    break
                self.names.append(name.group(1))
                self.args_sent.append("")
                deltas.append({"index": i, **_call(name.group(1), "")})
            args = _arguments_text(body, complete)
            if args is not None and len(args) > len(self.args_sent[i]):
                deltas.append(
                    {"index": i, "function": {"arguments": args[len(self.args_sent[i]) :]}}
                )
                self.args_sent[i] = args
        if self.req.parallel is False:
            deltas = [d for d in deltas if d["index"] == 0]
        return deltas


def _call_bodies(text: str) -> list[tuple[str, bool]]:
    bodies, pos = [], 0
    while (start := text.find(START, pos)) >= 0:
        end = text.find(END, start)
        if end < 0:
            raw = text[start + len(START) :]
            raw = raw[: len(raw) - _partial_overlap(raw, END)].strip()
            # valid JSON before its closing tag: the body is whole, the tag still to come
            bodies.append((raw, _is_json(raw)))
            break
        bodies.append((text[start + len(START) : end].strip(), True))
        pos = end + len(END)
    return bodies


def _arguments_text(body: str, complete: bool) -> Optional[str]:
    """The arguments' text as far as it came (vLLM's hermes streaming): what follows
    `"arguments":`, less the brace that closes the call once the call is complete."""
    found = re.search(r'"arguments"\s*:\s*', body)
    if found is None:
        return None
    raw = body[found.end() :]
    if complete:
        raw = raw.rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw
    return raw


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return bool(text)


def _partial_overlap(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
