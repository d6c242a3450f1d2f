"""The repository's example programs, as the playground offers them to start from: each folder of
`examples/` with a main.py (its .py files, a bundle) or a main.js (its .js modules), and the named inputs its main
reads (`input["k"]`: required; `input.get("k", default)`: optional, with its default when that is
a literal; JavaScript's `input.k`, and `input.k ?? default`)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

from ...program import parse_python

__all__ = ["EXAMPLES_DIR", "examples"]

# examples/ sits beside the package in a checkout (an installed wheel has none: the list is empty)
EXAMPLES_DIR = Path(__file__).resolve().parents[3] / "examples"
_JS_INPUT = re.compile(r"\binput(?:\.([A-Za-z_$][\w$]*)|\[\s*[\"']([^\"']+)[\"']\s*\])"
                       r"(\s*\?\?\s*(-?\d+(?:\.\d+)?|'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"|true|false|\[\]|\{\})?)?")


def python_inputs(source: str) -> list[dict[str, Any]]:
    """The inputs a Python main reads from its `input` dict, in the order they first appear."""
    found: dict[str, dict[str, Any]] = {}
    try:
        tree = parse_python(source)
    except SyntaxError:
        return []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "input"
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            found.setdefault(node.slice.value, {"name": node.slice.value, "required": True, "line": node.lineno})
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "input" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            entry = {"name": node.args[0].value, "required": False, "line": node.lineno}
            if len(node.args) > 1:
                try:
                    entry["default"] = ast.literal_eval(node.args[1])
                except ValueError:                   # a name or an expression: no default to show
                    pass
            found.setdefault(entry["name"], entry)
    return [{k: v for k, v in entry.items() if k != "line"}
            for entry in sorted(found.values(), key=lambda e: e["line"])]


def javascript_inputs(source: str) -> list[dict[str, Any]]:
    """The inputs a JavaScript main reads (`input.k`, `input["k"]`), in order of first use: optional
    where it falls back (`input.k ?? default`), with the default when that is a literal."""
    found: dict[str, dict[str, Any]] = {}
    for m in _JS_INPUT.finditer(source):
        name, fallback, literal = m.group(1) or m.group(2), m.group(3), m.group(4)
        entry = found.setdefault(name, {"name": name, "required": True})
        if fallback and entry["required"]:
            entry["required"] = False
            if literal is not None:
                # a quoted JavaScript string as JSON: single quotes become double ones
                text = '"' + literal[1:-1].replace('\\\'', "'").replace('"', '\\"') + '"' \
                    if literal.startswith("'") else literal
                entry["default"] = json.loads(text)
    return list(found.values())


def _files(folder: Path, suffix: str) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob(f"*{suffix}"))
            if "__pycache__" not in p.parts and "node_modules" not in p.parts}


def _example(folder: Path, root: Path) -> dict[str, Any] | None:
    name = folder.relative_to(root).as_posix()
    if (folder / "main.py").is_file():
        files = _files(folder, ".py")
        return {"name": name, "language": "python", "main": "main.py", "files": files,
                "inputs": python_inputs(files["main.py"])}
    if (folder / "main.js").is_file():
        files = _files(folder, ".js")
        return {"name": name, "language": "javascript", "main": "main.js", "files": files,
                "inputs": javascript_inputs(files["main.js"])}
    return None


def examples(root: Path = EXAMPLES_DIR) -> list[dict[str, Any]]:
    """Every example under `root`, by name ("quickstart", "agents/debate", "js/quickstart"):
    {name, language, main, files: {path: text}, inputs: [{name, required, default?}]}."""
    if not root.is_dir():
        return []
    folders = sorted({p.parent for p in (*root.rglob("main.py"), *root.rglob("main.js"))})
    return [e for e in (_example(f, root) for f in folders) if e is not None]
