"""Stop strings on the text side: hold back what could start a stop, cut at the match on finish.

The scheduler decides the finish (it checks stop strings after every token and reports
`matched_str` in the same step that completed it); this only makes sure the client never sees
text at or past a stop:
  - while running, the longest suffix of the unsent text that is a proper prefix of some stop
    string is held back (a stop may span several tokens and steps);
  - a complete stop string that arrives without a finish was deliberately not a stop (e.g. before
    min_new_tokens), so it is released;
  - on a `matched_str` finish the unsent text is cut at the first occurrence of the matched string
    (keeping it when no_stop_trim); on any other finish everything held is released.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def held_suffix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops`."""
    if not text:
        return 0
    last, best = text[-1], 0
    for stop in stops:
        # Longest candidates first; a prefix can only match if it ends in the text's last character
        # (a cheap index test before the slice and compare).
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if stop[k - 1] == last and text.endswith(stop[:k]):
                best = k
                break
    return best


class StopTrimmer:
    """Per-request text gate for stop strings."""

    __slots__ = ("stops", "no_stop_trim", "held")

    def __init__(self, stops: tuple[str, ...], no_stop_trim: bool) -> None:
        self.stops = tuple(s for s in stops if s)
        self.no_stop_trim = no_stop_trim
        self.held = ""

    def feed(self, text: str) -> str:
        """Text that can be sent now, given new committed text of a running request."""
        if not self.stops:
            return text
        buf = self.held + text
        keep = held_suffix_len(buf, self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def finish(self, text: str, matched_str: str | None, rid: str = "") -> str:
        """The rest of the text at finish: cut at the matched stop string when there is one."""
        buf = self.held + text
        self.held = ""
        if not matched_str:
            return buf
        cut = buf.find(matched_str)
        if cut < 0:
            # The scheduler saw the stop in its own decode of the tail; if the text here lacks it
            # (e.g. it was released earlier as a non-stop), send what is left untrimmed.
            log.warning("rid=%s matched stop string %r not in unsent text; not trimmed", rid, matched_str)
            return buf
        return buf[:cut + len(matched_str)] if self.no_stop_trim else buf[:cut]
