"""What `make run MODEL=...` takes, through the real launcher and services: a GGUF file serves; a
model that cannot be served stops everything with one line, before any service starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ringserve.model_source import fetch_smollm2
from tests.e2e.stack import running_stack

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out
    assert all(w in errors[0] for w in words), errors[0]


def test_a_gguf_file_serves_and_answers(real_model_dir: str) -> None:
    gguf = fetch_smollm2()  # the .gguf itself, as `make run MODEL=path/x.gguf` passes it
    with running_stack(str(gguf)) as stack:
        r = httpx.post(f"{stack.gateway_url}/v1/chat/completions", timeout=120, json={
            "model": Path(real_model_dir).name, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        r.raise_for_status()
        assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_a_missing_path_stops_the_launcher_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    proc = run_module("ringserve.launcher", "--model", str(missing))
    assert_one_line_error(proc, str(missing), "accepted")
    assert "starting detokenizer" not in proc.stdout + proc.stderr  # checked before any service starts


def test_an_unsupported_architecture_stops_the_launcher_with_one_line(model_dir: str, tmp_path: Path) -> None:
    other = tmp_path / "neox"
    shutil.copytree(model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"]}))
    proc = run_module("ringserve.launcher", "--model", str(other))
    assert_one_line_error(proc, "GPTNeoXForCausalLM", "supported: ", "LlamaForCausalLM", "Gemma3ForCausalLM")
    assert "starting detokenizer" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("service", ["services.detokenizer", "services.scheduler", "services.tokenizer"])
def test_each_service_alone_refuses_a_missing_model_with_one_line(service: str, tmp_path: Path) -> None:
    missing = tmp_path / "missing-model"
    proc = run_module(service, "--model", str(missing), "--metrics-port", "-1")
    assert proc.returncode == 2
    assert_one_line_error(proc, str(missing))
