"""What passing a streamed message on costs a process on this machine, before any of the ring's own work.

    python -m bench.hop_floor [--rate 400] [--rows 30] [--messages 4000] [--kind tcp|grpc]

Each hop of the ring is one long-lived stream carrying one message per decode step (that step's rows),
so every step wakes each service once: the detokenizer and the tokenizer read a message and write one
on, the gateway reads the last and writes each row to its HTTP client (one socket write per token per
request, as any server streaming tokens does). This runs that chain with nothing else in it: a source
writes `messages` messages at `rate` a second, a relay reads each and writes it on, a sink reads them
and writes each row's chunk (the size of an SSE event) to its own connection from a client process;
the relay's and the sink's process CPU time over the messages is what a middle service and the last
one pay for the streams alone. Two kinds of hop, one after the other: raw TCP streams on uvloop (the
least any process-per-service design pays) and grpc.aio server streams of SubscribeResponses with
`rows` text deltas each (what the ring's hops carry), gRPC core set up as every ringserve process sets
it (ringserve.grpc_env); the client connections are raw TCP in both. `bench.ring_cpu` runs it at the
step rate and rows its ring run reached, so the ring's CPU per token is read against this floor in the
same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from ringserve import grpc_env

grpc_env.apply()  # before grpc loads: the streams as every ringserve process sets gRPC core up

import grpc  # noqa: E402

from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc  # noqa: E402

T = TypeVar("T")
KINDS = ("tcp", "grpc")
CHUNK = b"data: " + json.dumps({"text": "x" * 40, "output_ids": list(range(1000, 1016)), "meta_info": {
    "id": "0" * 32, "finish_reason": None, "prompt_tokens": 256, "completion_tokens": 16}}).encode() + b"\n\n"


@dataclass(frozen=True)
class Floor:
    kind: str           # tcp or grpc
    rate: float         # messages a second
    rows: int           # text deltas a message
    relay_us: float     # CPU microseconds per message of a process that reads it and writes it on
    sink_us: float      # ... of the process that reads it last and writes each row to its client

    @property
    def ring_us_per_token(self) -> float:
        """The ring's three services at this floor, per streamed token: two relays (detokenizer,
        tokenizer) and a sink (the gateway)."""
        return (2 * self.relay_us + self.sink_us) / self.rows


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _message(rows: int) -> bytes:
    resp = detokenizer_pb2.SubscribeResponse(step_sent_at=time.time())
    for i in range(rows):
        resp.deltas.add(rid=f"{i:032x}", token_offset=i, ids=[1234], text_offset=4 * i, text=" tok",
                        prompt_tokens=256)
    return resp.SerializeToString()


class _Meter:
    """CPU time from the first message on (starting up and connecting are no message's cost)."""

    def __init__(self) -> None:
        self.n, self.c0 = 0, 0.0

    def tick(self) -> None:
        if not self.n:
            self.c0 = _cpu_s()
        self.n += 1

    def us(self) -> float:
        return (_cpu_s() - self.c0) / max(1, self.n - 1) * 1e6


def _ready(port: int) -> None:
    print(port, flush=True)  # the port, once listening: the next process may connect


# ---- raw TCP ---------------------------------------------------------------------------------------

async def _tcp_serve(lines: AsyncIterator[bytes]) -> None:
    """Listen, take one connection, write every item of `lines` to it, close."""
    done = asyncio.get_running_loop().create_future()

    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for data in lines:
            writer.write(data)
        writer.close()
        done.set_result(None)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    _ready(server.sockets[0].getsockname()[1])
    await done
    server.close()


async def _tcp_read(port: int, size: int, meter: _Meter) -> AsyncIterator[bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while True:
        try:
            data = await reader.readexactly(size)
        except asyncio.IncompleteReadError:  # the writer closed: that was the last message
            break
        meter.tick()
        yield data
    writer.close()


# ---- gRPC ------------------------------------------------------------------------------------------

async def _grpc_serve(messages: AsyncIterator[detokenizer_pb2.SubscribeResponse]) -> None:
    """Serve one Subscribe call that streams every item of `messages`."""
    done = asyncio.get_running_loop().create_future()

    class Servicer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
        async def Subscribe(self, request: detokenizer_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[detokenizer_pb2.SubscribeResponse]:
            async for msg in messages:
                yield msg
            done.set_result(None)

    server = grpc.aio.server()
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(Servicer(), server)
    _ready(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await done
    await server.stop(1.0)


async def _grpc_read(port: int, meter: _Meter) -> AsyncIterator[detokenizer_pb2.SubscribeResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = detokenizer_pb2_grpc.DetokenizerServiceStub(channel).Subscribe(
            detokenizer_pb2.SubscribeRequest(owner="floor"))
        while (resp := await call.read()) is not grpc.aio.EOF:
            meter.tick()
            yield resp


# ---- the sink's clients ----------------------------------------------------------------------------

async def _clients(n: int) -> AsyncIterator[asyncio.StreamWriter]:
    """Listen, take n connections (the sink's HTTP clients), and hand them out, one per row."""
    conns: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue(n)

    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await conns.put(writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    _ready(server.sockets[0].getsockname()[1])
    for _ in range(n):
        yield await conns.get()
    server.close()


async def _client_reads(port: int, n: int) -> None:
    """n connections to the sink, each read to its end."""
    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while await reader.read(1 << 16):
            pass
        writer.close()
    await asyncio.gather(*(one() for _ in range(n)))


async def _sink(messages: AsyncIterator[object], rows: int) -> None:
    writers = [w async for w in _clients(rows)]
    async for _ in messages:
        for w in writers:  # a row's text to its own client
            w.write(CHUNK)
    for w in writers:
        w.close()


# ---- roles -----------------------------------------------------------------------------------------

async def _paced(items: list[T], rate: float) -> AsyncIterator[T]:
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        yield item
        await asyncio.sleep(max(0.0, t0 + (i + 1) / rate - time.perf_counter()))


async def _role(args: argparse.Namespace) -> None:
    raw = _message(args.rows)
    meter = _Meter()
    if args.kind == "tcp":
        if args.role == "source":
            await _tcp_serve(_paced([raw] * args.messages, args.rate))
        elif args.role == "relay":
            await _tcp_serve(_tcp_read(args.port, len(raw), meter))
        elif args.role == "sink":
            await _sink(_tcp_read(args.port, len(raw), meter), args.rows)
        else:
            await _client_reads(args.port, args.rows)
            return
    else:
        if args.role == "source":
            await _grpc_serve(_paced([detokenizer_pb2.SubscribeResponse.FromString(raw)] * args.messages, args.rate))
        elif args.role == "relay":
            await _grpc_serve(_grpc_read(args.port, meter))
        elif args.role == "sink":
            await _sink(_grpc_read(args.port, meter), args.rows)
        else:
            await _client_reads(args.port, args.rows)
            return
    if args.role != "source":
        print(json.dumps({"us": meter.us()}), flush=True)


def measure(kind: str, rate: float, rows: int, messages: int) -> Floor:
    """The chain source -> relay -> sink -> clients of `kind`; the relay's and the sink's CPU per message."""
    cmd = [sys.executable, "-m", "bench.hop_floor", "--kind", kind, "--rate", str(rate), "--rows", str(rows),
           "--messages", str(messages), "--role"]
    procs: list[subprocess.Popen[str]] = []
    try:
        port = "0"
        for role in ("source", "relay", "sink"):
            procs.append(subprocess.Popen([*cmd, role, "--port", port], stdout=subprocess.PIPE, text=True))
            out = procs[-1].stdout
            assert out is not None
            port = out.readline().strip()  # printed once it listens
            if not port.isdigit():
                raise RuntimeError(f"hop_floor {kind} {role} did not start")
        # The sink subscribes to the relay once its clients are connected.
        subprocess.run([*cmd, "client", "--port", port], check=True, timeout=messages / rate + 120)
        results = []
        for p in procs[1:]:
            assert p.stdout is not None
            results.append(json.loads(p.stdout.readline())["us"])
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return Floor(kind, rate, rows, *results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hop_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=400.0, help="messages a second (the ring: decode steps a second)")
    ap.add_argument("--rows", type=int, default=30, help="text deltas a message (the ring: requests a step)")
    ap.add_argument("--messages", type=int, default=4000)
    ap.add_argument("--kind", choices=KINDS, default=None, help="one of them (default: both)")
    ap.add_argument("--role", choices=("source", "relay", "sink", "client"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role is not None:
        import uvloop

        uvloop.run(_role(args))
        return 0
    for kind in [args.kind] if args.kind else KINDS:
        print(f"[bench] {kind}: {args.messages} messages of {args.rows} rows at {args.rate:g}/s through a relay",
              file=sys.stderr, flush=True)
        f = measure(kind, args.rate, args.rows, args.messages)
        print(f"{kind}: relay {f.relay_us:,.1f} us, sink {f.sink_us:,.1f} us of CPU per message (its {f.rows} "
              f"writes to clients included); two relays and a sink, as the ring's services: "
              f"{f.ring_us_per_token:,.1f} us per token", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
