"""The tool-call formats of the model families, by `--tool-call-parser` name (SGLang's names).

    make_tool_parser(name: str, tools: list[dict]) -> ToolCallParser   # ValueError naming an unknown value
    detect_tool_parser(chat_template: str | None) -> str | None         # a name picked from template markers
    TOOL_PARSERS: dict[str, type[ToolCallParser]]

Each format is a ToolCallParser (tool_calls.py) that names its markers and decides one block; the streaming,
holding back, declared-tool check and bare-call rule are shared. What each block looks like:

- hermes / qwen25: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several allowed.
- qwen3_coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
  a value is typed by the tool's JSON schema (integer, number, boolean, null, object, array), else a string.
- llama3: `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or alone at the start of the output,
  several separated by `;`.
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` and the newer `[TOOL_CALLS]NAME[ARGS]{...}`
  (optionally `NAME[CALL_ID]ID[ARGS]{...}`).
- pythonic: `[get_weather(city="Paris"), f(x=1)]` (Llama 3.2/4 and others), optionally inside Llama 4's
  `<|python_start|>...<|python_end|>`; read with `ast`, values must be literals (nothing is evaluated).
- deepseekv3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; each call is its own block, the section tokens are dropped.

Markers such as `<|python_tag|>`, `[TOOL_CALLS]` and DeepSeek's are special tokens: the text must be
detokenized with them kept for these formats to see them.
"""

from __future__ import annotations

import ast
import math
import re
from typing import Any

from .tool_calls import JSON, Scan, ToolCallParser, call_from_json, json_call_prefix_ok


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _tagged(text: str, open_tag: str, close_tag: str, final: bool) -> tuple[str, int] | None:
    """(inner text, end) of `open_tag ... close_tag` at the start of text; at the end of the stream a block
    whose close tag never came runs to the end of the text. None: the close tag may still come."""
    close = text.find(close_tag, len(open_tag))
    if close != -1:
        return text[len(open_tag) : close], close + len(close_tag)
    if not final:
        return None
    return text[len(open_tag) :], len(text)


class HermesParser(ToolCallParser):
    """Hermes / Qwen2.5 / Qwen3: one JSON call object per `<tool_call>` block."""

    markers = ("<tool_call>",)

    def scan_block(self, text: str, final: bool) -> Scan | None:
        block = _tagged(text, "<tool_call>", "</tool_call>", final)
        if block is None:
            return None
        inner, end = block
        try:
            call = call_from_json(JSON.decode(inner))
        except ValueError:
            call = None
        return Scan(end, [call] if call else None)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")


class Qwen3CoderParser(ToolCallParser):
    """Qwen3-Coder's XML: one `<function=NAME>` with `<parameter=P>` children per `<tool_call>` block."""

    markers = ("<tool_call>",)

    def scan_block(self, text: str, final: bool) -> Scan | None:
        block = _tagged(text, "<tool_call>", "</tool_call>", final)
        if block is None:
            return None
        inner, end = block
        m = _FUNCTION.fullmatch(inner)
        if m is None:
            return Scan(end, None)
        name = m.group(1).strip()
        args = self._parameters(m.group(2), self.tools.get(name, {}))
        return Scan(end, [(name, args)] if args is not None else None)

    def _parameters(self, body: str, schema: dict[str, Any]) -> dict[str, Any] | None:
        """The parameters of a function body, or None when the body holds anything else.

        A value runs to its `</parameter>`; a missing close tag is forgiven when the next `<parameter=`
        or the end of the function follows (the model's own parser does the same).
        """
        opens = list(_PARAMETER.finditer(body))
        if body[: opens[0].start() if opens else len(body)].strip():
            return None
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        args: dict[str, Any] = {}
        for k, m in enumerate(opens):
            stop = opens[k + 1].start() if k + 1 < len(opens) else len(body)
            raw = body[m.end() : stop]
            close = raw.rfind("</parameter>")
            if close != -1:
                if raw[close + len("</parameter>") :].strip():
                    return None
                raw = raw[:close]
            # the template writes `<parameter=P>\nVALUE\n</parameter>`: those two newlines are markup
            raw = raw.removeprefix("\n").removesuffix("\n")
            pname = m.group(1).strip()
            spec = props.get(pname)
            args[pname] = _typed_value(raw, spec if isinstance(spec, dict) else {})
        return args


def _typed_value(raw: str, schema: dict[str, Any]) -> Any:
    """A qwen3_coder parameter value typed by its JSON schema; a string when untyped or not convertible."""
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if "string" in kinds or not kinds - {None}:
        return raw
    text = raw.strip()
    if "integer" in kinds or "number" in kinds:
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if math.isfinite(number):  # JSON has no NaN or Infinity: those stay strings
            if number.is_integer() and "integer" in kinds:
                return int(number)
            if "number" in kinds:
                return number
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "null" in kinds and text in ("null", "None"):
        return None
    if "object" in kinds or "array" in kinds:
        try:
            value = JSON.decode(text)
        except ValueError:
            try:  # models sometimes write a Python literal ({'a': 1}, True)
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return raw
        wanted = tuple(t for k, t in (("object", dict), ("array", list)) if k in kinds)
        if isinstance(value, wanted):
            return value
    return raw


class Llama3Parser(ToolCallParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, `;`-separated, after `<|python_tag|>`
    or alone at the start of the output."""

    markers = ("<|python_tag|>",)
    start_openers = ("{",)

    def scan_block(self, text: str, final: bool) -> Scan | None:
        i = len("<|python_tag|>") if text.startswith("<|python_tag|>") else 0
        found: list[tuple[str, dict[str, Any]]] = []
        while True:
            j = _skip_ws(text, i)
            if j == len(text):
                if not final:
                    return None
                return Scan(len(text), found or None)
            if text[j] != "{" or not json_call_prefix_ok(text[j:]):
                # not (or no longer) a call: the block ends before this text
                return Scan(max(i, 1), None) if not found else Scan(i, found)
            try:
                obj, k = JSON.raw_decode(text, j)
            except ValueError:
                return Scan(len(text), None) if final else None
            call = call_from_json(obj)
            if call is None:
                return Scan(k, None)
            found.append(call)
            m = _skip_ws(text, k)
            if m == len(text):
                if not final:
                    return None  # a `;` and another call may follow
                return Scan(len(text), found)
            if text[m] != ";":
                return Scan(k, found)
            i = m + 1


_MISTRAL_HEAD = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")
_MISTRAL_HEAD_PARTIAL = re.compile(r"\s*[A-Za-z0-9_.\-]*")
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _mistral_head_may_grow(rest: str) -> bool:
    """Whether rest (after `[TOOL_CALLS]`) is the start of `NAME[ARGS]` or `NAME[CALL_ID]ID[ARGS]`."""
    m = _MISTRAL_HEAD_PARTIAL.match(rest)
    tail = rest[m.end() :] if m else rest
    if "[ARGS]".startswith(tail) or "[CALL_ID]".startswith(tail):
        return True
    if not tail.startswith("[CALL_ID]"):
        return False
    return "[ARGS]".startswith(tail[len("[CALL_ID]") :].lstrip(_ALNUM))


class MistralParser(ToolCallParser):
    """Mistral: `[TOOL_CALLS]` then a JSON list of calls, or (newer tokenizers) `NAME[ARGS]{...}`."""

    markers = ("[TOOL_CALLS]",)

    def scan_block(self, text: str, final: bool) -> Scan | None:
        i = len("[TOOL_CALLS]")
        j = _skip_ws(text, i)
        if j == len(text):
            return None if not final else Scan(len(text), None)
        if text[j] in "[{":
            try:
                value, k = JSON.raw_decode(text, j)
            except ValueError:
                return Scan(len(text), None) if final else None
            items = value if isinstance(value, list) else [value]
            found = [call_from_json(v) for v in items]
            if not found or any(f is None for f in found):
                return Scan(k, None)
            return Scan(k, [f for f in found if f is not None])
        head = _MISTRAL_HEAD.match(text, i)
        if head is None:
            if not final and _mistral_head_may_grow(text[i:]):
                return None
            return Scan(i, None)
        a = _skip_ws(text, head.end())
        if a == len(text):
            return None if not final else Scan(len(text), None)
        if text[a] != "{":
            return Scan(a, None)
        try:
            args, k = JSON.raw_decode(text, a)
        except ValueError:
            return Scan(len(text), None) if final else None
        return Scan(k, [(head.group(1), args)])


_PYTHONIC_HEAD = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_PYTHONIC_HEAD_PARTIAL = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")


def _pythonic_calls(source: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of `[f(a=1), g(b="x")]`, or None; only literal keyword arguments are accepted."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    found: list[tuple[str, dict[str, Any]]] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        found.append((node.func.id, args))
    return found


class PythonicParser(ToolCallParser):
    """Python-call syntax: `[get_weather(city="Paris"), f(x=1)]`, anywhere in the text or inside Llama 4's
    `<|python_start|>...<|python_end|>`."""

    markers = ("<|python_start|>", "[")

    def scan_block(self, text: str, final: bool) -> Scan | None:
        if text.startswith("<|python_start|>"):
            block = _tagged(text, "<|python_start|>", "<|python_end|>", final)
            if block is None:
                return None
            inner, end = block
            return Scan(end, _pythonic_calls(inner.strip()))
        if _PYTHONIC_HEAD.match(text) is None:
            if not final and _PYTHONIC_HEAD_PARTIAL.fullmatch(text):
                return None
            return Scan(1, None)
        # the list ends at the first `]` up to which the text is a complete Python expression
        close = text.find("]")
        while close != -1:
            try:
                ast.parse(text[: close + 1], mode="eval")
            except SyntaxError:
                close = text.find("]", close + 1)
                continue
            return Scan(close + 1, _pythonic_calls(text[: close + 1]))
        return Scan(1, None) if final else None


_DSV3_CALL = re.compile(r"\s*(\w*)<｜tool▁sep｜>\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*", re.DOTALL)


class DeepSeekV3Parser(ToolCallParser):
    """DeepSeek V3 / R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`,
    each call its own block; the section's begin and end tokens around them are dropped."""

    markers = ("<｜tool▁call▁begin｜>",)
    dropped = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

    def scan_block(self, text: str, final: bool) -> Scan | None:
        block = _tagged(text, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", final)
        if block is None:
            return None
        inner, end = block
        m = _DSV3_CALL.fullmatch(inner)
        if m is None or m.group(1) not in ("", "function"):
            return Scan(end, None)
        try:
            args = JSON.decode(m.group(3))
        except ValueError:
            return Scan(end, None)
        return Scan(end, [(m.group(2), args)] if isinstance(args, dict) else None)


# When neither --tool-call-parser nor the chat template names one: the most common format, whose
# parser also reads the bare JSON calls that small models write.
DEFAULT_TOOL_PARSER = "hermes"

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "deepseekv3": DeepSeekV3Parser,
}


def make_tool_parser(name: str, tools: list[dict[str, Any]]) -> ToolCallParser:
    """A fresh parser (one per sample) of the named format for the request's tools."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser: unknown value {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return cls(tools)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches, from the markup it writes; None when it shows none."""
    if not chat_template:
        return None
    t = chat_template
    if "<tool_call>" in t:
        return "qwen3_coder" if "<function=" in t else "hermes"
    if "<｜tool▁calls▁begin｜>" in t or "<｜tool▁call▁begin｜>" in t:
        return "deepseekv3"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    # Llama 3.2 / 4 pythonic templates teach `[func_name1(params_name1=params_value1, ...), ...]`
    if "[func_name1(" in t or "<|python_start|>" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t):
        return "llama3"
    return None
