"""README.md and docs/ speak to users: no development diary, and nothing in them that the tree contradicts.

- no development "sessions", scratch paths (/tmp/...) or first-person lab notes;
- every repository path they name exists, and every relative link resolves;
- every `make` target the README names is in the Makefile, and every `--flag` it names is a flag of the
  launcher, a service, the gateway or `make bench` (flags are the config dataclasses' fields);
- the Performance table lies between the markers `make bench-table` rewrites.
The README's quick-start commands are run against the real processes in tests/e2e/test_readme.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted([README, *(ROOT / "docs").rglob("*.md")])
# Top-level entries of the tree a path in backticks may start with (generated ringserve/v1/ included:
# `make proto` has made it before any test runs).
TOP = sorted(p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci")


def _lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), start=1))


def _hits(pattern: re.Pattern[str]) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in DOCS for n, line in _lines(p) if pattern.search(line)]


def test_no_development_sessions_scratch_paths_or_lab_notes() -> None:
    """History belongs in git: what was tried and when goes in commit messages, not in the docs."""
    assert not _hits(re.compile(r"\bsessions?\b", re.I)), "a development session named in the docs"
    assert not _hits(re.compile(r"/tmp/")), "a scratch path in the docs"
    assert not _hits(re.compile(r"\b(we|our)\b", re.I)), "first-person notes in the docs"


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _repo_paths(text: str) -> set[str]:
    """Backticked words that name a path in the tree: `services/scheduler/core/engine.py`, `docker/`."""
    found = set()
    for span in _code_spans(text):
        for word in span.split():
            word = word.strip("(),;:'\"")
            head = word.split("/", 1)[0]
            if "/" in word and head in TOP and not re.search(r"[<>{}$=]|\.\.\.", word):
                found.add(word)
    return found


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in _repo_paths(text):
            if not (list(ROOT.glob(path.rstrip("/"))) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{doc.relative_to(ROOT)}: `{path}`")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            if not (doc.parent / target.split("#", 1)[0]).exists():
                missing.append(f"{doc.relative_to(ROOT)}: link ({target})")
    assert not missing, missing


def _make_targets() -> set[str]:
    return {m for line in (ROOT / "Makefile").read_text().splitlines()
            for m in re.findall(r"^([a-z][\w-]*):", line)}


def _flags() -> set[str]:
    """Every flag the launcher, the three services, the gateway and `python -m bench` accept."""
    from bench.__main__ import parse as bench_parse
    from gateway.config import GatewayConfig
    from ringserve.launcher import LauncherConfig
    from services.detokenizer.config import DetokenizerConfig
    from services.scheduler.config import SchedulerServerConfig
    from services.tokenizer.config import TokenizerConfig

    flags = {"--help"}
    for cls in (LauncherConfig, SchedulerServerConfig, TokenizerConfig, DetokenizerConfig, GatewayConfig):
        for f in dataclasses.fields(cls):
            flags.add("--" + f.name.replace("_", "-"))
            if f.type in ("bool", bool):  # parse_config gives booleans --no-<flag> too
                flags.add("--no-" + f.name.replace("_", "-"))
    flags |= set(vars(bench_parse([])))  # attribute names, turned into flags below
    return {f if f.startswith("--") else "--" + f.replace("_", "-") for f in flags}


def test_the_readme_names_only_make_targets_and_flags_that_exist() -> None:
    text = README.read_text()
    targets = {m for span in _code_spans(text) + re.findall(r"```bash\n(.*?)```", text, re.S)
               for m in re.findall(r"\bmake ([a-z][\w-]*)", span)}
    assert targets >= {"run", "test", "bench-table"}, targets
    assert targets <= _make_targets(), targets - _make_targets()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    # others' flags the README names: SGLang bench_serving's --backend (it runs unmodified), Helm's --set
    unknown = named - _flags() - {"--backend", "--set"}
    assert not unknown, f"flags the README names that nothing accepts: {sorted(unknown)}"


def test_the_performance_table_sits_between_the_bench_table_markers() -> None:
    from bench.publish import DOCS_MARKERS, README_MARKERS

    text = README.read_text()
    start, end = (text.index(m) for m in README_MARKERS)
    perf = text.index("## Performance")
    assert perf < start < end < text.index("\n## ", perf + 1)
    assert "| workload |" in text[start:end], "make bench-table has not filled the README's table"
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert docs.index(DOCS_MARKERS[0]) < docs.index(DOCS_MARKERS[1])


def test_the_readme_is_a_first_read() -> None:
    assert len(README.read_text().splitlines()) < 250


def test_readme_lists_the_served_architectures() -> None:
    """The list comes from the model registry (services/scheduler/models/__init__.py): regenerate it with
    `python -c "from services.scheduler.models import supported_line; print(supported_line())"`."""
    from services.scheduler.models import supported_line

    assert supported_line() in " ".join(README.read_text().split())
