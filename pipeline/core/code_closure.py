"""The code a stage's result depends on: its module's import closure over pipeline/ and stages/, read statically.

A stage's fingerprint hashes these files (pipeline/core/runner.py), so editing any code the stage can reach re-runs
it, and editing code it cannot reach (the CLI, reports, other stages' libraries) leaves it cached. Read from the AST
once per process: imports inside functions count, and so do `importlib.import_module(...)` / `__import__(...)` with a
literal name (an f-string's literal prefix stands for its whole package: f"pipeline.models.{name}" -> every module of
pipeline.models). A package's __init__ runs when any of its modules is imported, so it counts too; a module run as a child process
(`[sys.executable, "-m", "pipeline.engines.lite_child", ...]`) counts as imported.

EXCLUDED: code that cannot change what a stage computes or judges; the walk neither hashes nor goes through it.
"""
from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "stages")

EXCLUDED = {
    "pipeline.cli": "the command line: argument parsing and exit codes",
    "pipeline.cli_tools": "subcommands (verify, serve, nightly, accept) that run after the stages, never inside one",
    "pipeline.cli_rank": "the launched rank's entry script: imports, then hands over to the rank worker",
    "pipeline.core.console": "what the console and the native log show, not what is computed",
    "pipeline.core.summary": "the summary table printed after a run",
    "pipeline.nightly.report": "the nightly's report text",
    "pipeline.core.runlock": "the run folder's lock: who may write, not what is written",
    "pipeline.core.supervise": "the watcher that names a stage the kernel killed",
    "pipeline.core.resources": "peak-memory figures recorded beside the result",
}


def module_file(name: str) -> Path | None:
    """pipeline.engines.ov -> pipeline/engines/ov.py (or a package's __init__.py); None outside the repo's code."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    parts = Path(path).resolve().relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def dynamic_import(node: ast.AST) -> str | None:
    """The module an `importlib.import_module(...)` / `import_module(...)` / `__import__(...)` call names: a literal,
    or an f-string's literal prefix up to its last dot followed by ".*" (the whole package); None otherwise."""
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
        prefix = str(arg.values[0].value).rpartition(".")[0]
        return f"{prefix}.*" if prefix else None
    return None


def _statements(body: list):
    """Every statement, nested ones too (functions, classes, if/try/with/for bodies): where imports can stand."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _statements(getattr(node, field, None) or [])


@lru_cache(maxsize=None)
def _named(path: Path) -> frozenset[str]:
    """Every module name the file imports (statements anywhere in it, importlib literals), unresolved."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    names: set[str] = set()
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}    # `from pkg import module`
    if "import_module" in text or "__import__" in text or '"-m"' in text:     # expressions: walk them all
        names |= {n for node in ast.walk(tree) for n in (dynamic_import(node), child_module(node)) if n is not None}
    return frozenset(names)


def child_module(node: ast.AST) -> str | None:
    """The module a command list runs as a child process: [sys.executable, "-m", "pipeline.engines.lite_child", ...]
    -> "pipeline.engines.lite_child" (its code decides the stage's result as much as an import does)."""
    if not isinstance(node, (ast.List, ast.Tuple)):
        return None
    items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    for flag, name in zip(items, items[1:]):
        if flag == "-m" and isinstance(name, str):          # `-m package` runs the package's __main__
            return f"{name}.__main__" if module_file(f"{name}.__main__") is not None else name
    return None


def _resolve(name: str) -> list[str]:
    """A name -> the repo modules it loads: itself (when it is a module), every parent package, or with ".*" every
    module of the package."""
    if name.endswith(".*"):
        pkg = name[:-2]
        folder = module_file(pkg)
        if folder is None or folder.name != "__init__.py":
            return _resolve(pkg)
        return [*_resolve(pkg), *(module_name(p) for p in sorted(folder.parent.rglob("*.py")))]
    parts = name.split(".")
    return [n for n in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if module_file(n) is not None]


@lru_cache(maxsize=None)
def closure(start: Path) -> tuple[Path, ...]:
    """The files the module at `start` reaches through imports (itself included), EXCLUDED ones left out."""
    start = Path(start).resolve()
    files = {start}
    seen = {module_name(start)} if start.is_relative_to(ROOT) else set()
    todo = [m for n in _named(start) for m in _resolve(n)]
    while todo:
        name = todo.pop()
        if name in seen or name in EXCLUDED:
            continue
        seen.add(name)
        path = module_file(name)
        files.add(path)
        todo += [m for n in _named(path) for m in _resolve(n)]
    return tuple(sorted(files))


def file_digest(path: Path) -> bytes:
    """What a file contributes to a fingerprint (its bytes' hash; b"<missing>" for a file that is not there)."""
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).digest() if p.is_file() else b"<missing>"
