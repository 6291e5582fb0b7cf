"""No code path can deserialize or evaluate request data: no pickle/marshal imports, no eval/exec.

SGLang moves Python objects between processes with pickle over ZMQ; ringserve moves only protobuf.
This AST scan keeps it that way for every module under services/, gateway/ and ringserve/
(generated ringserve/v1 excluded).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "gateway", "ringserve")
FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "_pickle", "jsonpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
             if (ROOT / "ringserve" / "v1") not in p.parents]
    assert len(files) > 50  # the scan really looked at the code base
    return files


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {name}")  # type: ignore[attr-defined]
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            # builtins.eval / torch.load-style attribute calls named eval/exec count too; a method
            # named `compile` on a regex or grammar object is fine (re.compile, xgrammar compile_*).
            if isinstance(fn, ast.Name) and name in FORBIDDEN_CALLS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(")
            elif isinstance(fn, ast.Attribute) and name in ("eval", "exec") and \
                    isinstance(fn.value, ast.Name) and fn.value.id == "builtins":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: builtins.{name}(")
    return found


def test_no_pickle_eval_or_exec() -> None:
    found = [v for path in sources() for v in violations(path)]
    assert not found, "forbidden deserialization/evaluation:\n" + "\n".join(found)


def test_the_scan_catches_each_form(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom cloudpickle import loads\nimport marshal as m\n"
                   "eval('1')\nexec('x=1')\nimport builtins\nbuiltins.eval('2')\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert len(violations(bad)) == 6
    finally:
        ROOT = saved
