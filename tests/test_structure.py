"""The package structure the README promises, read from the code itself (no exception lists).

- `pipeline/` holds only the CLI entry points and packages at its top level;
- imports between packages point one way, down the order below (imports inside functions count, and so do
  `importlib.import_module(...)` / `__import__(...)` calls naming a module by a literal, or an f-string's literal
  prefix: f"stages.{name}" counts as importing `stages`);
- a request's path from `serving` stays inside serving, engines and the part it runs: only `serving.app`
  (start-up: open, verify and load a bundle) reads the bundle package.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bottom to top: a package may import its own modules and any package to its left, never one to its right
ORDER = ["core", "engines", "data", "models", "ocr", "tasks", "training", "bundle", "serving", "evaluation",
         "scale", "nightly", "stages", "cli"]
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "cli_tools.py", "cli_rank.py"}


def _modules() -> dict[str, Path]:
    files = list((ROOT / "pipeline").rglob("*.py")) + list((ROOT / "stages").glob("*.py"))
    out = {}
    for p in files:
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "stages":
        return "stages"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ORDER) else "cli"


def dynamic_import(node: ast.AST) -> str | None:
    """The module an `importlib.import_module(...)` / `import_module(...)` / `__import__(...)` call names: a literal
    string, or the literal prefix of an f-string up to its last dot (f"stages.{x}" -> "stages"); None otherwise."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
    if name not in ("import_module", "__import__"):
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return prefix.rpartition(".")[0] or None
    return None


def _longest_known(name: str, mods: dict) -> str:
    while name not in mods and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path, mods: dict) -> list[tuple[int, str]]:
    """(line, module) of every pipeline/stages import in the file, inside functions too, importlib literals too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        named = dynamic_import(node)
        if named:
            found.append((node.lineno, _longest_known(named, mods)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import (write the package out)"
            base = node.module or ""
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base) for a in node.names]
    return [(n, m) for n, m in found if m.split(".")[0] in ("pipeline", "stages") and m != "pipeline"]


def test_dynamic_imports_are_read():
    """The order test sees importlib's literal names (the catalogue once reached `stages` this way)."""
    tree = ast.parse('import importlib\nimportlib.import_module("stages")\nimportlib.import_module(f"stages.{m}")\n'
                     '__import__("pipeline.engines.ov")\nimportlib.import_module(name)\n')
    named = [dynamic_import(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert sorted(n for n in named if n) == ["pipeline.engines.ov", "stages", "stages"]


def test_pipeline_top_level_holds_only_entry_points_and_packages():
    loose = sorted(p.name for p in (ROOT / "pipeline").glob("*.py") if p.name not in TOP_LEVEL)
    assert not loose, f"modules at pipeline/'s top level (give them a package): {loose}"
    for pkg in ORDER[:-2]:
        assert (ROOT / "pipeline" / pkg / "__init__.py").is_file(), pkg
        doc = ast.get_docstring(ast.parse((ROOT / "pipeline" / pkg / "__init__.py").read_text()))
        assert doc, f"pipeline/{pkg}/__init__.py has no docstring saying what the package offers"


def test_imports_between_packages_point_down():
    mods = _modules()
    upward = []
    for name, path in mods.items():
        src = _package(name)
        for line, target in _imports(path, mods):
            dst = _package(target)
            if ORDER.index(dst) > ORDER.index(src):
                upward.append(f"{path.relative_to(ROOT)}:{line} ({src}) imports {target} ({dst})")
    assert not upward, "imports pointing up the package order:\n" + "\n".join(upward)


def test_a_request_stays_inside_serving_engines_and_the_part_it_runs():
    mods = _modules()
    allowed = {"serving", "engines", "ocr", "tasks", "data", "models", "core"}
    leaks = []
    for name, path in mods.items():
        if _package(name) != "serving" or name == "pipeline.serving.app":
            continue
        leaks += [f"{name}:{line} imports {t}" for line, t in _imports(path, mods) if _package(t) not in allowed]
    assert not leaks, "request-path modules reaching outside serving/engines/ocr/tasks:\n" + "\n".join(leaks)


def test_the_readme_states_the_same_package_order():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^Package order \(bottom to top\): (.+)$", readme, re.M)
    assert m, "README has no 'Package order (bottom to top): ...' line"
    assert [s.strip(" `.") for s in m.group(1).split("<")] == ORDER
