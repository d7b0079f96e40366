"""No deserialization of code from the network in the Django-free packages.

The engine, KV transfer, worker servers and router take bytes from peers and clients; everything
they parse must be JSON (or raw KV bytes received into a tensor). This scans their source with the
`ast` module (not a text grep: comments and docstrings may say "no pickle") and fails on:
pickle/cPickle/dill/shelve/marshal/joblib imports, eval/exec/compile calls, `torch.load` without
`weights_only=True`, `numpy.load(..., allow_pickle=True)` and `yaml.load` without a safe loader.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["inference/engine", "inference/kv_transfer", "inference/server", "inference/router"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "shelve", "marshal", "joblib", "cloudpickle"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.expr) -> str:
    """`torch.load` for Attribute(Name('torch'), 'load'); '' for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def findings(source: str, filename: str) -> list[str]:
    """Every unsafe construct in one module, as 'file:line: what'."""
    problems: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNSAFE_MODULES:
                    problems.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in UNSAFE_MODULES:
                problems.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if isinstance(node.func, ast.Name) and node.func.id in UNSAFE_BUILTINS:
                problems.append(f"{where}: {node.func.id}()")
            elif name.endswith("torch.load"):
                if not _is_true(_keyword(node, "weights_only")):
                    problems.append(f"{where}: torch.load without weights_only=True")
            elif name in ("np.load", "numpy.load") and _is_true(_keyword(node, "allow_pickle")):
                problems.append(f"{where}: numpy.load(allow_pickle=True)")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                loader = _keyword(node, "Loader")
                if name != "yaml.load" or loader is None or "Safe" not in _dotted(loader):
                    problems.append(f"{where}: {name} without SafeLoader")
            elif name.endswith(("pickle.loads", "pickle.load", "marshal.loads", "marshal.load")):
                problems.append(f"{where}: {name}")
    return problems


def test_the_scanner_catches_what_it_should() -> None:
    bad = "\n".join([
        "import pickle",
        "from marshal import loads",
        "import torch",
        "torch.load(f)",
        "torch.load(f, weights_only=False)",
        "eval(x)",
        "exec(x)",
        "import numpy as np",
        "np.load(f, allow_pickle=True)",
        "import yaml",
        "yaml.load(s)",
    ])
    assert len(findings(bad, "bad.py")) == 8  # every line but the plain torch, numpy and yaml imports
    good = "\n".join([
        '"""no pickle here"""  # pickle in a comment is fine',
        "import torch",
        "torch.load(f, weights_only=True)",
        "model.eval()",
        "import yaml",
        "yaml.load(s, Loader=yaml.SafeLoader)",
        "import json",
        "json.loads(s)",
    ])
    assert findings(good, "good.py") == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_unpickling_of_network_data(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package} has no Python files?"
    problems = [p for f in files for p in findings(f.read_text(), str(f.relative_to(ROOT)))]
    assert problems == [], "unsafe deserialization:\n" + "\n".join(problems)
