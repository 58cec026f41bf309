"""A stage's fingerprint covers the code it reaches (its import closure, pipeline/core/code_closure.py), so a cached
verdict is one today's code would give (fast: the AST and one probe process, no stage runs)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import catalogue, code_closure
from pipeline.core.runner import _code_hash, code_files

ROOT = Path(__file__).resolve().parent.parent


def _stage_file(stage) -> Path:
    return Path(sys.modules[stage.run.__module__].__file__).resolve()


def _reached_by_the_structure_reader(start: Path) -> set[Path]:
    """The modules a stage reaches, read by tests/test_structure.py's own import reader (a second, independent
    reading of the same AST), the walk stopping at the declared exclusions as the fingerprint's does."""
    from test_structure import _imports, _modules

    mods = _modules()
    by_file = {p.resolve(): n for n, p in mods.items()}
    seen, todo = set(), [by_file[start]]
    while todo:
        name = todo.pop()
        if name in seen or name in code_closure.EXCLUDED:
            continue
        seen.add(name)
        todo += [t for _, t in _imports(mods[name], mods) if t in mods]
    return {mods[n].resolve() for n in seen}


@pytest.mark.parametrize("name", list(catalogue.stages()))
def test_every_module_a_stage_reaches_is_in_its_fingerprint(name):
    stage = catalogue.stages()[name]
    covered = {p.resolve() for p in code_files(stage)}
    outside = sorted(str(p.relative_to(ROOT)) for p in _reached_by_the_structure_reader(_stage_file(stage)) - covered)
    assert not outside, f"the {name} stage reaches modules its fingerprint does not hash: {outside}"


def test_every_module_loaded_with_a_stage_is_in_its_fingerprint():
    """Dynamic check: what really loads when each stage module is imported (alone, without the `stages` package) is in
    its fingerprint, or is excluded reporting code and what only it loads."""
    probe = (
        "import importlib.util, json, sys\n"
        "out = {}\n"
        "for name, path in json.loads(sys.argv[1]).items():\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] in ('pipeline', 'stages')]:\n"
        "        del sys.modules[m]\n"
        "    spec = importlib.util.spec_from_file_location('_probe_' + name, path)\n"
        "    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module)\n"
        "    out[name] = sorted(getattr(m, '__file__', None) or '' for k, m in sys.modules.items()\n"
        "                       if k.split('.')[0] in ('pipeline', 'stages'))\n"
        "print(json.dumps(out))\n")
    files = {n: str(_stage_file(s)) for n, s in catalogue.stages().items()}
    res = subprocess.run([sys.executable, "-c", probe, json.dumps(files)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    excluded = set()
    for mod in code_closure.EXCLUDED:          # reporting code and what it loads: left out on purpose
        excluded |= {p.resolve() for p in code_closure.closure(code_closure.module_file(mod))}
    for name, loaded in json.loads(res.stdout).items():
        covered = {p.resolve() for p in code_files(catalogue.stages()[name])} | excluded
        outside = sorted(str(Path(f).resolve().relative_to(ROOT)) for f in loaded if f and Path(f).resolve() not in covered)
        assert not outside, f"importing the {name} stage loads modules its fingerprint does not hash: {outside}"


def test_exclusions_are_few_named_modules_with_reasons():
    assert len(code_closure.EXCLUDED) <= 10
    for mod, why in code_closure.EXCLUDED.items():
        assert code_closure.module_file(mod) is not None, f"excluded module {mod} does not exist"
        assert len(why) > 20, f"{mod}: say why its code cannot change a stage's result"


def test_closure_reads_function_imports_importlib_literals_and_child_processes(tmp_path):
    src = tmp_path / "probe.py"
    src.write_text("import importlib, sys\n"
                   "def f():\n    from pipeline.engines import ov\n"
                   "def g(n):\n    return importlib.import_module(f'pipeline.models.{n}')\n"
                   "CMD = [sys.executable, '-m', 'pipeline.engines.lite_child', 'serve']\n")
    got = {str(p.relative_to(ROOT)) for p in code_closure.closure(src) if p.is_relative_to(ROOT)}
    assert {"pipeline/engines/ov.py", "pipeline/engines/__init__.py", "pipeline/__init__.py",
            "pipeline/models/registry.py", "pipeline/models/crnn.py", "pipeline/engines/lite_child.py"} <= got
    assert "pipeline/cli.py" not in got


def test_a_change_in_engines_re_runs_the_deployment_stages_and_not_training(monkeypatch):
    """Issue 46: editing pipeline/engines/ov.py (here: its digest) changes the code hash of server, bundle and
    system; lite re-runs because it reads the server's new outputs; train and export keep theirs."""
    stages = catalogue.stages()
    before = {n: _code_hash(s) for n, s in stages.items()}
    ov = (ROOT / "pipeline" / "engines" / "ov.py").resolve()
    real = code_closure.file_digest
    monkeypatch.setattr(code_closure, "file_digest",
                        lambda p: real(p) + (b"# one more comment" if Path(p).resolve() == ov else b""))
    changed = {n for n, s in stages.items() if _code_hash(s) != before[n]}
    assert changed == {"server", "bundle", "system"}, changed
    assert "server" in stages["lite"].inputs       # and a re-run server gives lite other input hashes
    assert not {"train", "export"} & changed
