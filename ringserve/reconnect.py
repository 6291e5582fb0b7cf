"""Keep a long-lived stream up: run a session, and when it ends or breaks, back off and run it again.

`handshake` is how a client of the detokenizer's streams knows its stream is registered: the
detokenizer's first message on Push and on Subscribe is empty, and a stream counts as up only once it
has arrived.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 5.0


async def handshake(call, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bool:
    """Wait for the server's first (empty) message on a streaming call; False if the stream ended
    first or nothing came within timeout_s (the caller drops the call and reconnects)."""
    try:
        return await asyncio.wait_for(call.read(), timeout_s) is not grpc.aio.EOF
    except TimeoutError:
        return False


async def reconnect_forever(name: str, session: Callable[[], Awaitable[None]], on_down: Callable[[], None],
                            min_s: float = 0.1, max_s: float = 2.0, stable_s: float = 5.0) -> None:
    """Run `session()` forever (until cancelled); `on_down()` after each end, whatever ended it.

    The backoff doubles from min_s to max_s between failed attempts and starts over once a session
    has stayed up for stable_s, so a peer that restarts is found again within about min_s.
    """
    backoff = min_s
    while True:
        started = time.monotonic()
        try:
            await session()
            reason = "stream ended"
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001 - keep reconnecting whatever broke
            log.exception("%s failed", name)
            reason = repr(e)
        finally:
            on_down()
        if time.monotonic() - started > stable_s:
            backoff = min_s
        log.debug("%s: %s; retry in %.1fs", name, reason, backoff)
        await asyncio.sleep(backoff)  # reconnect backoff, not a readiness wait
        backoff = min(max_s, backoff * 2)
