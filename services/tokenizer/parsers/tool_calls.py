"""Tool calls in a model's output: the data types and the streaming machinery every format shares.

Interface (the wiring codes against exactly this):

    parser = make_tool_parser("hermes", request.tools)      # tool_formats.make_tool_parser
    for text_delta in sample_text_deltas:
        content, calls = parser.feed(text_delta)            # ToolDeltas(content: str, calls: list[ToolCallDelta])
        ...
    content, calls = parser.finish()                        # at end of stream: flushes what was held back
    result = parser.parse(full_text)                        # ParseResult(content, calls: list[ToolCall])

One parser object per sample (it holds that sample's state). `parse` does not touch that state: it runs a
fresh parser of the same kind over the whole text, so a whole-text parse and a stream always agree.

The rules every format follows:

- Only calls of declared tools are reported. A block naming an undeclared tool, or one that does not parse
  (malformed JSON, a missing close tag), stays in the content as the text the model wrote; nothing raises.
  A block holding several calls (a Mistral list, a `;`-chain, a pythonic list) is reported whole or kept whole.
- Markup never leaks into content for a call that is reported: text that might be the start of a call
  (a prefix of `<tool_call>`, an opened block) is held back until it is decided, and a half-written call at
  the end of the stream comes back from finish() as content, never lost.
- A call is reported once its own markup is complete, as ONE ToolCallDelta carrying index, id, name and the
  whole arguments JSON (OpenAI's first-delta shape; a client that concatenates argument fragments gets that
  JSON). The name is not sent earlier on purpose: a call whose JSON later turns out malformed must go back to
  the content, and a name delta already sent could not be taken back.
- The bare-call rule: when tools were given and the whole output (stripped, possibly in a ```json fence) is
  exactly one call object `{"name": ..., "arguments"|"parameters": {...}}` or a JSON list of them, naming
  declared tools, it counts as call(s) for every format. Small models answer that way without their markup.
  Output that starts like that is held until it is decided (at finish, or once it can no longer be a call).
- Ids are `call_` + 24 random hex digits, one per call.

A format (tool_formats.py) is a ToolCallParser subclass that names its markers and scans one block.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from ringserve.v1 import api_pb2


@dataclass(frozen=True)
class ToolCall:
    """A complete call, as OpenAI's message.tool_calls[i]: arguments is JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call, shaped like OpenAI's delta.tool_calls[i].

    The first delta of a call carries index, id and name; later ones (if any) only index and an argument
    fragment. The concatenation of a call's argument fragments is its arguments JSON.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_pb(self) -> api_pb2.ToolCallDelta:
        return api_pb2.ToolCallDelta(index=self.index, id=self.id or "", name=self.name or "",
                                     arguments=self.arguments)


@dataclass(frozen=True)
class ParseResult:
    """A whole text parsed: the content left once the calls are taken out, and the calls in order."""

    content: str
    calls: list[ToolCall]


class ToolDeltas(NamedTuple):
    """What one feed() or finish() gives: the content delta and the call deltas decided by it."""

    content: str
    calls: list[ToolCallDelta]


class Scan(NamedTuple):
    """A format's decision on the block at the start of a text.

    end: characters of the text the block covers (> 0). calls: the (name, arguments) it holds, or None when
    it is not a call after all, in which case text[:end] stays content and parsing goes on after it.
    """

    end: int
    calls: list[tuple[str, dict[str, Any]]] | None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def assemble_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Join streamed deltas back into complete calls, by index, in first-seen order."""
    heads: dict[int, ToolCallDelta] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in heads:
            heads[d.index] = d
            args[d.index] = []
        args[d.index].append(d.arguments)
    return [ToolCall(id=h.id or "", name=h.name or "", arguments="".join(args[i])) for i, h in heads.items()]


_CALL_KEYS = frozenset({"name", "arguments", "parameters", "type", "id"})
_ARG_KEYS = ("arguments", "parameters")
_FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\n")
_FENCE_PARTIAL = re.compile(r"`{1,3}|```(?:j|js|jso|json)?[ \t]*")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json reads NaN and Infinity, which no JSON client accepts back: arguments holding them are refused.
JSON = json.JSONDecoder(parse_constant=_no_constant)


def call_from_json(obj: object) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a JSON call object `{"name": ..., "arguments"|"parameters": {...}}`, else None.

    Besides those, only "type": "function" and "id" (Mistral writes it back in history) are allowed: an
    object with other keys is data the model wrote, not a call. Arguments given as a JSON string of an
    object (some fine-tunes do that) are decoded.
    """
    if not isinstance(obj, dict) or not set(obj) <= _CALL_KEYS:
        return None
    name = obj.get("name")
    present = [k for k in _ARG_KEYS if k in obj]
    if not isinstance(name, str) or not name or len(present) != 1:
        return None
    if "type" in obj and obj["type"] != "function":
        return None
    args = obj[present[0]]
    if isinstance(args, str):
        try:
            args = JSON.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, args


def json_call_prefix_ok(text: str) -> bool:
    """Whether text (starting with `{` or `[`) can still grow into a call object or a list of them.

    A cheap look at the first key only: it lets ordinary output such as `[1] See...` or `{Hello}` go out
    at once instead of being held to the end of the stream.
    """
    i = 0
    if text[0] == "[":
        i = _skip_ws(text, 1)
        if i == len(text):
            return True
    if text[i] != "{":
        return False
    i = _skip_ws(text, i + 1)
    if i == len(text):
        return True
    if text[i] != '"':
        return False
    close = text.find('"', i + 1)
    if close == -1:
        return any(k.startswith(text[i + 1 :]) for k in _CALL_KEYS)
    return text[i + 1 : close] in _CALL_KEYS


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class _Bare(NamedTuple):
    """The bare-call rule's verdict: calls (decided yes), or not_call (decided no); neither: undecided."""

    calls: list[tuple[str, dict[str, Any]]] | None
    not_call: bool


_UNDECIDED = _Bare(None, False)
_NOT_BARE = _Bare(None, True)


class ToolCallParser(ABC):
    """The streaming machine for one sample; subclasses describe a format.

    A subclass sets `markers` (strings that open a call block anywhere in the text), optionally `dropped`
    (wrapper tokens removed from the text, e.g. DeepSeek's section begin/end) and `start_openers`
    (strings that open a block only at the very start of the output, after whitespace: Llama 3's bare `{`),
    and implements scan_block.
    """

    markers: ClassVar[tuple[str, ...]] = ()
    dropped: ClassVar[tuple[str, ...]] = ()
    start_openers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self._tool_list = tools
        # name -> the JSON schema of its parameters ({} when the tool declares none)
        self.tools: dict[str, dict[str, Any]] = _declared_tools(tools)
        self._buf = ""
        self._at_start = True  # nothing but whitespace seen yet: the bare-call rule and start openers apply
        self._in_block = False  # _buf starts at a block opener
        self._next_index = 0
        self._all_markers = tuple(sorted(self.markers + self.dropped, key=len, reverse=True))

    # The public interface -------------------------------------------------------------------------------

    def feed(self, text_delta: str) -> ToolDeltas:
        """Take the next piece of the sample's text; give what is now decided."""
        self._buf += text_delta
        return self._drain(final=False)

    def finish(self) -> ToolDeltas:
        """End of stream: decide everything held back (an unfinished call becomes content)."""
        return self._drain(final=True)  # with final=True every path consumes the whole buffer

    def parse(self, text: str) -> ParseResult:
        """Parse a whole text, independently of this parser's streaming state."""
        fresh = type(self)(self._tool_list)
        head, tail = fresh.feed(text), fresh.finish()
        return ParseResult(head.content + tail.content, assemble_calls(head.calls + tail.calls))

    # What a format implements ---------------------------------------------------------------------------

    @abstractmethod
    def scan_block(self, text: str, final: bool) -> Scan | None:
        """Decide the block that text starts with (text starts with a marker or a start opener).

        Return None while undecided: more text could change the answer. Every decision must hold for any
        continuation of text (that is what makes the result independent of how the stream is cut); with
        final=True nothing more will come, and None is read as "not a call".
        """

    # The machine ----------------------------------------------------------------------------------------

    def _drain(self, final: bool) -> ToolDeltas:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if not self.tools:  # no call can be reported: nothing to hold back
            content.append(self._buf)
            self._buf = ""
            return ToolDeltas("".join(content), calls)
        while self._buf:
            if self._at_start:
                if not self._decide_start(final, content, calls):
                    break
                continue
            if self._in_block:
                scan = self.scan_block(self._buf, final)
                if scan is None:
                    if not final:
                        break
                    scan = Scan(len(self._buf), None)
                self._in_block = False
                block, self._buf = self._buf[: scan.end], self._buf[scan.end :]
                found = self._deltas(scan.calls) if scan.calls else None
                if found is None:
                    content.append(block)
                else:
                    calls.extend(found)
                continue
            pos, marker = self._find_marker(self._buf)
            if marker is None:
                keep = 0 if final else self._held_suffix(self._buf)
                content.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content.append(self._buf[:pos])
            if marker in self.dropped:
                self._buf = self._buf[pos + len(marker) :]
            else:
                self._buf = self._buf[pos:]
                self._in_block = True
        return ToolDeltas("".join(content), calls)

    def _decide_start(self, final: bool, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """Handle the start of the output; False: hold everything for now."""
        stripped = self._buf.lstrip()
        if not stripped:
            if final:
                content.append(self._buf)
                self._buf = ""
            return False
        bare = _bare_calls(stripped, self.tools, final)
        if bare.calls is not None:
            found = self._deltas(bare.calls)
            if found is not None:
                calls.extend(found)
                self._buf = ""
                return False
        elif not bare.not_call:
            return False
        self._at_start = False
        if any(stripped.startswith(o) for o in self.start_openers):
            content.append(self._buf[: len(self._buf) - len(stripped)])
            self._buf = stripped
            self._in_block = True
        return True

    def _deltas(self, found: list[tuple[str, dict[str, Any]]]) -> list[ToolCallDelta] | None:
        """The deltas of a block's calls, or None when the block is not reported (it stays content):
        an undeclared name, or arguments JSON cannot hold (a set or an infinity from a Python literal)."""
        texts = []
        for name, args in found:
            if name not in self.tools:
                return None
            try:
                texts.append(json.dumps(args, ensure_ascii=False, allow_nan=False))
            except (TypeError, ValueError):
                return None
        out = [ToolCallDelta(self._next_index + k, new_call_id(), name, text)
               for k, ((name, _), text) in enumerate(zip(found, texts))]
        self._next_index += len(out)
        return out

    def _find_marker(self, text: str) -> tuple[int, str | None]:
        best, found = len(text), None
        for m in self._all_markers:  # longest first, so a longer marker wins a tie
            i = text.find(m, 0, best + len(m))
            if i != -1 and i < best:
                best, found = i, m
        return best, found

    def _held_suffix(self, text: str) -> int:
        """Length of the longest end of text that is the start of a marker (it must wait for more text)."""
        longest = max((len(m) for m in self._all_markers), default=1) - 1
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[-k:]
            if any(m.startswith(tail) for m in self._all_markers):
                return k
        return 0


def _declared_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: a tool needs a name")
        params = fn.get("parameters") if isinstance(fn, dict) else None
        out[name] = params if isinstance(params, dict) else {}
    return out


def _bare_calls(text: str, tools: dict[str, dict[str, Any]], final: bool) -> _Bare:
    """The bare-call rule on the (left-stripped) output so far."""
    fenced = False
    if text.startswith("`"):
        m = _FENCE_OPEN.match(text)
        if m is None:
            return _UNDECIDED if not final and _FENCE_PARTIAL.fullmatch(text) else _NOT_BARE
        fenced = True
        text = text[m.end() :].lstrip()
        if not text:
            return _NOT_BARE if final else _UNDECIDED
    if text[0] not in "{[" or not json_call_prefix_ok(text):
        return _NOT_BARE
    try:
        value, end = JSON.raw_decode(text)
    except ValueError:
        return _NOT_BARE if final else _UNDECIDED
    items = value if isinstance(value, list) else [value]
    found = [call_from_json(v) for v in items]
    if not found or any(f is None or f[0] not in tools for f in found):
        return _NOT_BARE
    tail = text[end:].strip()
    if fenced:
        # a missing closing fence is forgiven at the end (the model stopped right after the JSON)
        if not "```".startswith(tail):
            return _NOT_BARE
    elif tail:
        return _NOT_BARE
    if not final:
        return _UNDECIDED
    return _Bare([f for f in found if f is not None], False)
