"""The README's quick start, run as written against the four processes serving the default model.

Each command of the Quick start section's shell blocks runs through bash with `localhost:30000` and
`localhost:50051` pointed at the test stack's gateway and tokenizer, curl told to fail on an HTTP error;
where the README shows a command's output (`$ command` then output), the output must be exactly that.
The Python block runs the same way and must print the answer the README shows. The Models section's
error example is checked against what a missing model prints. A command whose tool is not installed
(grpcurl) is skipped, not passed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, running_stack

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@dataclass(frozen=True)
class Command:
    text: str
    output: str | None  # what the README shows it printing, when it shows it

    @property
    def tool(self) -> str:
        return self.text.split()[0]


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _complete(cmd: str) -> bool:
    """A shell command is complete when its single quotes are closed and its last line does not continue."""
    return cmd.count("'") % 2 == 0 and not cmd.endswith("\\")


def commands(block: str) -> Iterator[Command]:
    """`$ cmd` lines (with the output that follows them) or bare commands, continuation lines joined."""
    lines = block.rstrip("\n").splitlines()
    shown = any(line.startswith("$ ") for line in lines)
    i = 0
    while i < len(lines):
        cmd = lines[i].removeprefix("$ ") if shown else lines[i]
        i += 1
        while not _complete(cmd) and i < len(lines):
            cmd += "\n" + lines[i]
            i += 1
        output = None
        if shown:
            out = []
            while i < len(lines) and not lines[i].startswith("$ "):
                out.append(lines[i])
                i += 1
            output = "\n".join(out)
        yield Command(cmd, output)


QUICK = [c for b in blocks(section("Quick start"), "bash") for c in commands(b)]
ANSWERS = [c.output for c in QUICK if c.output]


def local(text: str, stack: Stack) -> str:
    return (text.replace("localhost:30000", f"127.0.0.1:{stack.ports['gateway']}")
            .replace("localhost:50051", f"127.0.0.1:{stack.ports['tokenizer']}"))


@pytest.fixture(scope="module")
def stack(real_model_dir: str) -> Iterator[Stack]:
    with running_stack(real_model_dir) as s:
        yield s


def test_the_quick_start_shows_a_question_and_its_answer() -> None:
    assert QUICK and all(c.tool in ("curl", "grpcurl") for c in QUICK), QUICK
    assert ANSWERS and "Paris" in ANSWERS[0], ANSWERS


@pytest.mark.parametrize("cmd", QUICK, ids=[f"{c.tool}-{k}" for k, c in enumerate(QUICK)])
def test_each_quick_start_command_works(cmd: Command, stack: Stack) -> None:
    if shutil.which(cmd.tool) is None:
        pytest.skip(f"{cmd.tool} is not installed")
    text = local(cmd.text, stack)
    if cmd.tool == "curl":
        text = text.replace("curl ", "curl --fail-with-body -sS ", 1)  # an HTTP error fails the command
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", text], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd.text}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), cmd.text
    if cmd.output is not None:
        assert proc.stdout.rstrip("\n") == cmd.output


def test_the_python_example_prints_the_answer_shown(stack: Stack) -> None:
    (code,) = blocks(section("Quick start"), "python")
    proc = subprocess.run([sys.executable, "-c", local(code, stack)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == ANSWERS[0]


def test_the_missing_model_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    (example,) = [b for b in blocks(section("Models"), "") if b.startswith("$ make run MODEL=")]
    command, shown = example.rstrip("\n").split("\n", 1)
    model = command.split("MODEL=", 1)[1]
    assert not Path(model).exists()
    # `make run` prepares the model first (`make model`: ringserve.model_source), which prints this line
    proc = subprocess.run([sys.executable, "-m", "ringserve.model_source", model], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == shown
