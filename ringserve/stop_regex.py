"""stop_regex: the rules the three services share about a stop pattern (Python `re` syntax).

The tokenizer rejects a pattern that cannot be one (`problem`); the scheduler searches the output's
tail for one after every token, with a time limit, and reports how much text to cut
(services/scheduler/core/finish.py); the detokenizer holds back the text a match could still start
in while streaming (`span`) and cuts what the scheduler said (services/detokenizer/stop_trim.py).
Nothing here runs a pattern on text: only the scheduler does.

The search is bounded: SGLang searches the whole output for a pattern of unbounded width (`\\d+`,
`.*`), so a step's cost grows with the output. Here a match is looked for only in the text of the
last tokens, enough for `span(pattern)` characters (the longest text the pattern can match, capped at
LOOKBACK_CHARS); a longer match may be missed, and streaming holds back at most that many characters.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

# re's own parser, for a pattern's width and structure (`sre_parse` is its deprecated alias).
from re import _constants as sre_constants  # type: ignore[attr-defined]
from re import _parser as sre_parser  # type: ignore[attr-defined]
from typing import Any

LOOKBACK_CHARS = 64   # the longest match a stop pattern is sure to be found for (see the module doc)
_CACHE_SIZE = 1024    # patterns measured once per process, not once per step

_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, getattr(sre_constants, "POSSESSIVE_REPEAT", None))


@functools.lru_cache(maxsize=_CACHE_SIZE)
def span(pattern: str) -> int:
    """The most characters a match of `pattern` can cover, capped at LOOKBACK_CHARS."""
    _, hi = sre_parser.parse(pattern).getwidth()
    return int(min(hi, LOOKBACK_CHARS))


def max_span(patterns: Iterable[str]) -> int:
    return max((span(p) for p in patterns), default=0)


def _nested_unbounded(items: Any, inside: bool = False) -> bool:
    """Whether an unbounded repeat sits inside another one (`(a+)+`, `(?:x*y)*`): the shape whose
    backtracking takes exponential time on a near-miss, which would stall the scheduler's loop."""
    for op, av in items:
        if op in _REPEATS:
            _, hi, sub = av
            unbounded = hi == sre_constants.MAXREPEAT
            if (unbounded and inside) or _nested_unbounded(sub, inside or unbounded):
                return True
        elif op is sre_constants.SUBPATTERN:
            if _nested_unbounded(av[-1], inside):
                return True
        elif op is sre_constants.BRANCH:
            if any(_nested_unbounded(b, inside) for b in av[1]):
                return True
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            if _nested_unbounded(av[1], inside):
                return True
        elif op is getattr(sre_constants, "ATOMIC_GROUP", None):
            if _nested_unbounded(av, inside):
                return True
        elif op is sre_constants.GROUPREF_EXISTS:
            if any(b is not None and _nested_unbounded(b, inside) for b in av[1:]):
                return True
    return False


def problem(pattern: str) -> str | None:
    """Why `pattern` cannot be a stop pattern, or None when it can."""
    try:
        parsed = sre_parser.parse(pattern)
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return f"not a valid regular expression: {e}"
    if parsed.getwidth()[0] == 0:
        return "must not match the empty string (it would end every request at its first token)"
    if _nested_unbounded(parsed):
        return "nested unbounded repeats (like (a+)+) are refused: their matching can take exponential time"
    return None
