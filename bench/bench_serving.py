"""SGLang's bench_serving.py as the HTTP load generator, fetched at run time (never committed).

The script comes out of the sglang wheel (`pip download --no-deps`) into .cache/bench/ and runs in
its own small venv (.cache/bench/client-venv: aiohttp, numpy, transformers for the tokenizer,
datasets and pillow because it imports them at the top). It runs offline (HF_HUB_OFFLINE=1,
synthetic datasets only). Its `--output-file --output-details` JSONL line is turned into
`RequestRecord`s so every target is summarized by the same code.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import zipfile
from pathlib import Path

from bench.stats import RequestRecord
from bench.venvs import CACHE, ensure_venv, log
from bench.workloads import Workload

SGLANG_VERSION = "0.5.9"
SCRIPT = CACHE / f"sglang-{SGLANG_VERSION}-bench_serving.py"
CLIENT_PACKAGES = ["aiohttp", "numpy", "pybase64", "requests", "pillow", "tqdm", "transformers", "datasets"]


def fetch_script() -> Path:
    if SCRIPT.exists():
        return SCRIPT
    wheel_dir = CACHE / "sglang-wheel"
    wheels = sorted(wheel_dir.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        log(f"downloading the sglang=={SGLANG_VERSION} wheel for bench_serving.py")
        py = client_python()
        subprocess.run([str(py), "-m", "pip", "download", "--no-deps", f"sglang=={SGLANG_VERSION}",
                        "-d", str(wheel_dir)], check=True)
        wheels = sorted(wheel_dir.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        SCRIPT.write_bytes(z.read("sglang/bench_serving.py"))
    return SCRIPT


def client_python() -> Path:
    return ensure_venv("client-venv", CLIENT_PACKAGES)


def run(w: Workload, base_url: str, model_dir: Path, served_name: str, out_dir: Path,
        backend: str = "vllm", timeout: float = 1800, warmup: bool = True,
        extra_body: dict | None = None) -> tuple[list[RequestRecord], float, dict]:
    """One bench_serving run (with its one warm-up request unless `warmup` is False); returns
    (records, duration_s, bench_serving's own summary). `extra_body` is merged into each request."""
    script, py = fetch_script(), client_python()
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"bench_serving-{w.name}-{int(time.time() * 1000)}.jsonl"
    cmd = [str(py), str(script), "--backend", backend, "--base-url", base_url, "--model", str(model_dir),
           "--served-model-name", served_name, "--tokenizer", str(model_dir), *w.bench_serving_args(),
           "--output-file", str(out_file), "--output-details", "--disable-tqdm",
           "--warmup-requests", "1" if warmup else "0"]
    if extra_body:
        cmd += ["--extra-request-body", json.dumps(extra_body)]
    if backend == "sglang" and w.dataset == "random-ids":
        # Send token ids, as the gRPC target does: the same prompt lengths, so the two measure the
        # gateway's overhead on the same work (text prompts re-tokenize to ~20% more tokens here).
        cmd.append("--tokenize-prompt")
    # HOME: bench_serving caches generated-shared-prefix prompts under ~/.cache/sglang keyed without
    # the tokenizer path, so each model gets its own.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HOME": str(CACHE / "home" / model_dir.name), "TOKENIZERS_PARALLELISM": "false"}
    log_file = out_file.with_suffix(".log")
    with log_file.open("w") as lf:
        proc = subprocess.run(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not out_file.exists():
        tail = log_file.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"bench_serving exited with {proc.returncode}; {log_file}:\n{tail}")
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    return parse_details(result), float(result["duration"]), result


def parse_details(result: dict) -> list[RequestRecord]:
    """bench_serving's --output-details lists -> RequestRecords.

    `output_lens` holds successful requests only (in order); e2e is TTFT plus the ITLs (the time of
    the last output chunk), since per-request latencies are not in the details.
    """
    outs = iter(result["output_lens"])
    recs = []
    for plen, ttft, itls, err in zip(result["input_lens"], result["ttfts"], result["itls"], result["errors"]):
        if err:
            recs.append(RequestRecord(ok=False, prompt_len=plen, error=str(err)))
            continue
        recs.append(RequestRecord(ok=True, prompt_len=plen, output_len=next(outs), ttft=ttft, itls=list(itls),
                                  e2e=ttft + sum(itls)))
    return recs
