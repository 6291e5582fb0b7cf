"""Reasoning (`<think>...</think>`) split from the answer in a model's output.

Interface (the wiring codes against exactly this; it runs before the tool-call parser, which then sees only
the content part):

    parser = make_reasoning_parser("qwen3", thinking_enabled=True)   # ValueError naming an unknown value
    reasoning, content = parser.feed(text_delta)    # ReasoningDeltas(reasoning: str, content: str)
    reasoning, content = parser.finish()            # end of stream: flushes what was held back
    reasoning, content = parser.parse(full_text)    # ReasoningResult(reasoning: str | None, content: str)
    detect_reasoning_parser(chat_template) -> str | None
    REASONING_PARSERS: dict[str, type[ReasoningParser]]

One parser per sample. A request with separate_reasoning=False gets no parser (its text passes through);
thinking_enabled comes from chat_template_kwargs.enable_thinking (default True).

The two families (SGLang's names):

- deepseek-r1: the chat template already opened `<think>` (DeepSeek-R1, QwQ, Qwen3-Thinking-2507), so the
  output starts inside the reasoning: everything up to `</think>` is reasoning (an explicit `<think>` at the
  start is dropped too). As in SGLang, whose DeepSeekR1Detector always forces reasoning, an output that never
  closes it is all reasoning. thinking_enabled=False is for templates that then close the block in the prompt:
  the output is an answer, and only an explicit leading `<think>` opens reasoning.
- qwen3: reasoning only when the output starts with `<think>` (Qwen3's template leaves the model to open it);
  with thinking_enabled=False the template wrote `<think>\\n\\n</think>` itself and there is none: the text
  passes through untouched. A `<tool_call>` inside an unclosed reasoning block ends it and stays in the
  content (SGLang's Qwen3Detector does this: Qwen3 sometimes calls a tool without closing `</think>`).
  SGLang differs in one point: with enable_thinking on it forces reasoning for qwen3 too, so an answer that
  never writes `</think>` becomes reasoning; here such templates are detected as deepseek-r1 instead.

Tags never reach either side. The whitespace the templates put around the tags (`<think>\\n...\\n</think>\\n\\n`)
is markup too: reasoning is stripped, and content after `</think>` starts at its first non-blank character.
parse() runs a fresh parser over the whole text, so a whole-text parse and a stream always agree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import ClassVar, NamedTuple

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningDeltas(NamedTuple):
    reasoning: str
    content: str


class ReasoningResult(NamedTuple):
    """reasoning is None when the output had no reasoning block at all."""

    reasoning: str | None
    content: str


class _State(Enum):
    START = "start"  # nothing decided yet: is there a leading <think>?
    REASONING_LEAD = "reasoning_lead"  # inside reasoning, blanks after the open tag are dropped
    REASONING = "reasoning"
    CONTENT_LEAD = "content_lead"  # after </think>, blanks before the answer are dropped
    CONTENT = "content"


class ReasoningParser(ABC):
    """The streaming machine for one sample; a subclass says where reasoning starts and what ends it."""

    # strings that end an unclosed reasoning block and stay in the content (besides </think>, which is dropped)
    implicit_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self, thinking_enabled: bool = True) -> None:
        self.thinking_enabled = thinking_enabled
        self._buf = ""
        self._entered = False
        self._state = _State.START if self._parses(thinking_enabled) else _State.CONTENT
        self._forced = self._starts_inside(thinking_enabled)
        self._ends = (THINK_END, *self.implicit_ends)

    @abstractmethod
    def _starts_inside(self, thinking_enabled: bool) -> bool:
        """Whether the output starts inside the reasoning block (the template opened it)."""

    def _parses(self, thinking_enabled: bool) -> bool:
        """Whether the output can hold reasoning at all."""
        return True

    # The public interface -------------------------------------------------------------------------------

    def feed(self, text_delta: str) -> ReasoningDeltas:
        self._buf += text_delta
        return self._drain(final=False)

    def finish(self) -> ReasoningDeltas:
        return self._drain(final=True)  # with final=True every state consumes the whole buffer

    def parse(self, text: str) -> ReasoningResult:
        """Split a whole text, independently of this parser's streaming state."""
        fresh = type(self)(self.thinking_enabled)
        head, tail = fresh.feed(text), fresh.finish()
        reasoning = head.reasoning + tail.reasoning
        return ReasoningResult(reasoning if fresh._entered else None, head.content + tail.content)

    # The machine ----------------------------------------------------------------------------------------

    def _drain(self, final: bool) -> ReasoningDeltas:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            state = self._state
            if state is _State.START:
                lead = self._buf.lstrip()
                if lead.startswith(THINK_START):
                    self._buf = lead[len(THINK_START) :]
                    self._enter()
                elif not final and THINK_START.startswith(lead):
                    break  # blanks, or a prefix of <think>: wait
                elif self._forced:
                    self._enter()
                else:
                    self._state = _State.CONTENT
            elif state is _State.REASONING_LEAD or state is _State.CONTENT_LEAD:
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._state = _State.REASONING if state is _State.REASONING_LEAD else _State.CONTENT
            elif state is _State.REASONING:
                if not self._reason(final, reasoning):
                    break
            else:
                content.append(self._buf)
                self._buf = ""
        return ReasoningDeltas("".join(reasoning), "".join(content))

    def _enter(self) -> None:
        self._entered = True
        self._state = _State.REASONING_LEAD

    def _reason(self, final: bool, reasoning: list[str]) -> bool:
        """Move reasoning text out of the buffer; False: the rest must wait for more text."""
        pos, end = min(((self._buf.find(e), e) for e in self._ends if e in self._buf), default=(-1, ""))
        if pos != -1:
            reasoning.append(self._buf[:pos].rstrip())
            if end == THINK_END:
                self._buf = self._buf[pos + len(end) :]
                self._state = _State.CONTENT_LEAD
            else:
                self._buf = self._buf[pos:]
                self._state = _State.CONTENT
            return True
        if final:
            reasoning.append(self._buf.rstrip())
            self._buf = ""
            return False
        # hold a possible start of an end tag, and trailing blanks (they are dropped if </think> follows)
        keep = _partial_suffix(self._buf, self._ends)
        out = self._buf[: len(self._buf) - keep]
        out_kept = out.rstrip()
        reasoning.append(out_kept)
        self._buf = self._buf[len(out_kept) :]
        return False


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text that is a proper start of one of markers."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


class DeepSeekR1ReasoningParser(ReasoningParser):
    def _starts_inside(self, thinking_enabled: bool) -> bool:
        return thinking_enabled


class Qwen3ReasoningParser(ReasoningParser):
    implicit_ends = ("<tool_call>",)

    def _starts_inside(self, thinking_enabled: bool) -> bool:
        return False

    def _parses(self, thinking_enabled: bool) -> bool:
        return thinking_enabled


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def make_reasoning_parser(name: str, thinking_enabled: bool = True) -> ReasoningParser:
    """A fresh parser (one per sample) of the named family."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"reasoning_parser: unknown value {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        )
    return cls(thinking_enabled)


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning family a chat template implies: deepseek-r1 when its generation prompt opens `<think>`
    without closing it (the output starts inside the reasoning), qwen3 when it otherwise knows `<think>`."""
    if not chat_template or THINK_START not in chat_template:
        return None
    # the generation prompt is written after the template's last test of add_generation_prompt; Qwen3's
    # writes `<think>\n\n</think>` there only to switch thinking off, which opens nothing
    at = chat_template.rfind("add_generation_prompt")
    gen = chat_template[at:] if at != -1 else ""
    if gen.count(THINK_START) > gen.count(THINK_END):
        return "deepseek-r1"
    return "qwen3"
