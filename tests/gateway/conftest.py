"""Gateway fixtures: the fake tokenizer (in-process, own thread) and a real `python -m gateway`."""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import openai
import pytest

from ringserve.process import ServiceProcess, free_port, python_cmd
from tests.gateway.fake_tokenizer import FakeTokenizer

API_KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeTokenizer]:
    server = FakeTokenizer().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _reset_fake(request: pytest.FixtureRequest) -> None:
    if "fake" in request.fixturenames:
        fake = request.getfixturevalue("fake")
        fake.servicer.reset()
        fake.set_serving(True)


def start_gateway(fake: FakeTokenizer, *extra: str) -> tuple[ServiceProcess, str]:
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--tokenizer", fake.target, "--startup-timeout-s", "5",
            "--log-level", "warning", *extra]
    proc = ServiceProcess("gateway", python_cmd("gateway", *args), sink=io.StringIO()).start()
    try:
        proc.wait_ready_line(30)
    except BaseException:
        proc.stop()
        raise
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gateway(fake: FakeTokenizer) -> Iterator[str]:
    args = [a for k in API_KEYS for a in ("--api-key", k)] + ["--max-body-bytes", "64KiB"]
    proc, url = start_gateway(fake, *args)
    yield url
    proc.stop()


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key=API_KEYS[1], max_retries=0, timeout=10)


@pytest.fixture
def http(gateway: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {API_KEYS[0]}"}, timeout=10) as c:
        yield c
