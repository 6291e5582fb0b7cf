"""A tiny in-test DetokenizerService: collects the scheduler's StepBatches and can ask for resyncs."""

from __future__ import annotations

import queue
import threading
from concurrent import futures

import grpc

from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc


class FakeDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, port: int) -> None:
        self.port = port
        self.batches: list[detokenizer_pb2.StepBatch] = []
        self.scheduler_ids: list[str] = []
        self.cond = threading.Condition()
        self._control: queue.Queue = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def Push(self, request_iterator, context):
        def read() -> None:
            try:
                for msg in request_iterator:
                    with self.cond:
                        if msg.scheduler_id:
                            self.scheduler_ids.append(msg.scheduler_id)
                        if msg.HasField("batch"):
                            self.batches.append(msg.batch)
                        self.cond.notify_all()
            except grpc.RpcError:
                pass
            self._control.put(None)

        threading.Thread(target=read, daemon=True).start()
        yield detokenizer_pb2.PushResponse()  # the handshake, as the real detokenizer
        while True:
            item = self._control.get()
            if item is None:
                return
            yield item

    def request_resync(self, owner: str) -> None:
        self._control.put(detokenizer_pb2.PushResponse(resync=detokenizer_pb2.ResyncRequest(owner=owner)))

    def wait_for(self, pred, timeout: float = 30.0):
        """Block until pred(batches) is truthy; returns its value."""
        with self.cond:
            ok = self.cond.wait_for(lambda: pred(self.batches), timeout)
            assert ok, f"condition not met in {timeout}s; {len(self.batches)} batches"
            return pred(self.batches)

    def deltas(self, rid: str) -> list[detokenizer_pb2.TokenDelta]:
        with self.cond:
            return [d for b in self.batches if not b.resync for d in b.deltas if d.rid == rid]

    def stop(self) -> None:
        self._control.put(None)
        self.server.stop(0).wait()
