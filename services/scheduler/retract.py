"""Retraction: when decode needs more KV slots than exist, preempt requests and recompute them later.

A retracted request keeps its output ids; its prompt becomes prompt + output so far, so when it is
prefilled again it continues exactly where it stopped (greedy output is unchanged). Its KV goes into
the radix cache, so the recompute reuses whatever of it has not been evicted meanwhile.
"""

from __future__ import annotations

from services.scheduler.kv_manager import KVManager
from services.scheduler.req import Req


def retract_for_decode(running: list[Req], kv: KVManager) -> tuple[list[Req], list[Req]]:
    """Split running into (kept, retracted) so that every kept request gets one new slot.

    Victims are the requests with the least output (least work lost), longest prompt first, as in
    SGLang. At least one request is always kept.
    """
    if kv.available() >= len(running):
        return running, []
    order = sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
    retracted: list[Req] = []
    while len(order) > 1 and kv.available() < len(order):
        victim = order.pop()
        kv.release(victim, cache=True)
        victim.reset_for_recompute()
        retracted.append(victim)
    keep = set(map(id, order))
    return [r for r in running if id(r) in keep], retracted
