"""Scheduler discovery for `dns:///host:port` targets (a Kubernetes headless Service).

One long-lived Connect stream sticks to one backend, so gRPC's round_robin channel cannot spread a
tokenizer's requests over several scheduler pods. Instead the name is resolved to every address
behind it and the pool keeps one Connect stream per address, re-resolving periodically as pods come
and go. Plain `host:port` targets are used as they are.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
Resolver = Callable[[str, int], Awaitable[list[str]]]


def parse_dns_target(target: str) -> tuple[str, int] | None:
    """`dns:///name:port` -> (name, port); anything else -> None."""
    if not target.startswith(DNS_PREFIX):
        return None
    host, _, port = target[len(DNS_PREFIX):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"scheduler target {target!r}: expected dns:///host:port")
    return host.strip("[]"), int(port)


def join_host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(host: str, port: int) -> list[str]:
    """Every address of `host`, as sorted `ip:port` strings (empty when the name does not resolve)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        log.warning("cannot resolve %s: %s", host, e)
        return []
    return sorted({join_host_port(str(info[4][0]), port) for info in infos})


class SchedulerDiscovery:
    """Keeps `apply(target, addresses)` current for each dns:/// target."""

    def __init__(self, targets: list[str], apply: Callable[[str, list[str]], Awaitable[None]],
                 interval_s: float = 5.0, resolver: Resolver | None = None) -> None:
        self.targets = {t: parsed for t in targets if (parsed := parse_dns_target(t)) is not None}
        self.apply = apply
        self.interval_s = interval_s
        self.resolver = resolver
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        for target, (host, port) in self.targets.items():
            addresses = await (self.resolver or resolve)(host, port)
            if addresses:  # a failed lookup keeps what was known rather than dropping every pod
                await self.apply(target, addresses)

    async def start(self) -> None:
        if not self.targets:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="scheduler discovery")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)  # periodic re-resolution, not a readiness wait
            await self.refresh()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
