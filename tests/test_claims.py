"""The README's structural claims, read from the code (ast, the Makefile, the test ids): fast, no Paddle runs.

- no function over 60 lines in pipeline/ and stages/;
- every stage list comes from the catalogue (pipeline/core/catalogue.py): no hard-coded list of stage names;
- bundle paths are spelled only in pipeline/bundle/layout.py;
- one row runner: a failing row is made only by pipeline/core/gates.py (run_row/crashed), never in an except;
- what `make test` runs end to end.
The direction of imports between packages is tests/test_structure.py's.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 60
# what a bundle path looks like (pipeline/bundle/layout.py's constants)
BUNDLE_PATH = re.compile(r"server/(fp32|fp16|bf16|int8|onnx|openvino)|mobile/|(^|/)samples/|infer_config\.yaml|"
                         r"manifest\.json|MODEL_CARD\.md|expected\.(npz|json)|_fp32\.nb")
# the run folder's manifest name: core cannot import the bundle package (package order), and a run folder is not a
# bundle; layout.MANIFEST names the bundle's
RUN_FOLDER_SPELLINGS = {("pipeline/core/artifacts.py", "manifest.json"),
                        # a run folder may not lie inside a published bundle (issue 47): config recognises one by its
                        # two marker files; test_bundle_markers_match_the_layout keeps them layout's
                        ("pipeline/core/config.py", "manifest.json"), ("pipeline/core/config.py", "infer_config.yaml")}


def _sources() -> dict[str, ast.Module]:
    files = sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "stages").rglob("*.py")])
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(encoding="utf-8")) for p in files}


def _docstrings(tree: ast.Module) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _strings(tree: ast.Module):
    """(line, text) of every string literal that is not a docstring (f-string parts included)."""
    docs = _docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def test_no_function_is_over_60_lines():
    long = [f"{path}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for path, tree in _sources().items() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "functions over 60 lines (give their steps names): " + "; ".join(long)


def test_the_length_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    fn = ast.parse(f"def f():\n{body}\n").body[0]
    assert fn.end_lineno - fn.lineno + 1 == MAX_FUNCTION_LINES + 1


def _stage_names() -> set[str]:
    from pipeline.core.catalogue import stages

    return set(stages())


def _declaration_nodes(tree: ast.Module) -> set[int]:
    """The literals of Stage(...) declarations (inputs=, config_keys=): what the catalogue is built FROM."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Stage":
            out |= {id(v) for v in [*n.args, *(k.value for k in n.keywords)]}
    return out


def _stage_lists(tree: ast.Module, names: set[str]) -> list[tuple[int, list]]:
    declared = _declaration_nodes(tree)
    found = []
    for n in ast.walk(tree):
        elts = n.elts if isinstance(n, (ast.List, ast.Tuple, ast.Set)) else n.keys if isinstance(n, ast.Dict) else None
        if elts is None or id(n) in declared:
            continue
        hits = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]
        if len(hits) >= 2:
            found.append((n.lineno, hits))
    return found


def test_every_stage_list_comes_from_the_catalogue():
    names = _stage_names()
    assert {"train", "export", "server", "lite", "bundle"} <= names
    lists = [f"{path}:{line} {hits}" for path, tree in _sources().items() if path != "pipeline/core/catalogue.py"
             for line, hits in _stage_lists(tree, names)]
    assert not lists, "hard-coded stage lists (ask pipeline.core.catalogue): " + "; ".join(lists)


def test_the_stage_list_check_sees_a_hard_coded_list():
    tree = ast.parse('CHAIN = ["train", "export", "server"]\nS = Stage("lite", inputs=("export", "server"))\n')
    assert _stage_lists(tree, _stage_names()) == [(1, ["train", "export", "server"])]


def test_makefile_stage_targets_are_catalogue_stages():
    """The Makefile's one-stage targets (`pipeline run $@`) name stages the catalogue has, and every stage of a
    single-model run has one: a renamed or added stage breaks this test, not a user's `make`."""
    from pipeline.core.catalogue import stages

    make = (ROOT / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([\w -]+):.*\n((?:\t.*\n)+)", make, re.M):
        if "pipeline run $@" in m.group(2):
            targets |= set(m.group(1).split())
        elif re.search(r"pipeline run (\w+) ", m.group(2)):
            targets |= {re.search(r"pipeline run (\w+) ", m.group(2)).group(1)}
    single = {n for n, s in stages().items() if s.external_inputs is None}
    assert targets - {"all", "deploy"} <= set(stages()), targets
    assert single <= targets, f"stages without a make target: {sorted(single - targets)}"


def _bundle_spellings(path: str, tree: ast.Module) -> list[str]:
    return [f"{path}:{line} {text!r}" for line, text in _strings(tree) if BUNDLE_PATH.search(text)
            and not any(path == p and s in text for p, s in RUN_FOLDER_SPELLINGS)]


def test_bundle_markers_match_the_layout():
    from pipeline.bundle import layout
    from pipeline.core.config import BUNDLE_MARKERS

    assert BUNDLE_MARKERS == (layout.MANIFEST, layout.INFER_CONFIG)


def test_bundle_paths_are_spelled_only_in_the_layout_module():
    found = [s for path, tree in _sources().items() if path != "pipeline/bundle/layout.py"
             for s in _bundle_spellings(path, tree)]
    assert not found, "bundle paths spelled outside pipeline/bundle/layout.py (ask layout): " + "; ".join(found)


def test_the_bundle_path_check_sees_a_spelled_path():
    tree = ast.parse('"""docs may say server/fp32/inference"""\nP = b / "server/fp32/inference"\n'
                     'Q = f"{b}/samples/expected.json"\n')
    assert len(_bundle_spellings("x.py", tree)) == 2


def _failing_rows_in_excepts(tree: ast.Module) -> list[int]:
    """Lines of except handlers that build a failing row themselves (a Gate(...) or the FAIL verdict)."""
    lines = []
    for h in ast.walk(tree):
        if isinstance(h, ast.ExceptHandler):
            for n in ast.walk(h):
                name = getattr(n.func, "id", getattr(n.func, "attr", None)) if isinstance(n, ast.Call) else None
                if name == "Gate" or (isinstance(n, ast.Name) and n.id == "FAIL"):
                    lines.append(h.lineno)
                    break
    return lines


def test_one_row_runner_makes_every_failing_row():
    """An engine row's exception becomes its FAIL only through gates.run_row (any exception, traceback kept): a
    row code that catches some exceptions itself (the OCR system stage caught only PipelineError) is refused.
    A known limitation caught as SKIPPED with its reason is not a failing row."""
    found = [f"{path}:{line}" for path, tree in _sources().items() if path != "pipeline/core/gates.py"
             for line in _failing_rows_in_excepts(tree)]
    assert not found, "rows failed inside an except (use pipeline.core.gates.run_row): " + "; ".join(found)


def test_the_row_runner_check_sees_an_own_except():
    tree = ast.parse("try:\n    g = row()\nexcept PipelineError as e:\n    g = Gate('s', 'x', 'fp32', 'none', 'm', "
                     "status=FAIL)\n")
    assert _failing_rows_in_excepts(tree) == [3]


def test_make_test_runs_the_slow_tests_and_the_conformance_fast_slice():
    """`make test` is the whole suite, slow tests included; its end-to-end architecture slice is conformance's FAST
    (tests/test_zoo.py runs `conformance --fast`): today svtr_lcnet alone."""
    from pipeline.nightly.conformance import FAST, ZOO

    make = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", make, re.M).group(1)
    assert re.search(r"pytest -q tests\s*$", recipe) and "-m \"" not in recipe, recipe
    zoo_test = (ROOT / "tests" / "test_zoo.py").read_text()
    assert '"conformance", "--fast"' in zoo_test
    assert set(FAST) <= set(ZOO) and FAST == ("svtr_lcnet",)


def _documented_make_test_archs() -> list[tuple[str, set[str]]]:
    """(page, architectures) of every "`make test` runs ... end to end" sentence in README.md and docs/."""
    from pipeline.nightly.conformance import ZOO

    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"`make test` runs ([^.]*?) end to end", page.read_text()):
            found.append((page.name, {a for a in re.findall(r"`(\w+)`", m.group(1)) if a in ZOO}))
    return found


def test_the_docs_say_what_make_test_runs_end_to_end():
    """The docs once said `make test` runs lcnet end to end: it runs conformance's FAST slice (svtr_lcnet)."""
    from pipeline.nightly.conformance import FAST

    claims = _documented_make_test_archs()
    assert claims, "no page says which architectures `make test` runs end to end"
    assert all(archs == set(FAST) for _, archs in claims), claims


def test_the_system_stage_turns_any_engine_exception_into_that_rows_fail(tmp_path):
    """The OCR system's pair rows caught only PipelineError: a RuntimeError from an engine crashed the stage."""
    from pipeline.evaluation.system_rows import Chain, pair_row

    subs = {"detection": tmp_path, "recognition": tmp_path}
    chain = Chain({"images": []}, {}, None, {}, [], subs, evidence=tmp_path / "evidence")

    def make(role, bundle):
        raise RuntimeError("engine exploded")

    g = pair_row(chain, "onnxruntime fp32", "fp32", make, 0.01)
    assert g.status == "FAIL" and g.reason == "RuntimeError: engine exploded"
    assert (tmp_path / "evidence" / "onnxruntime_fp32.txt").is_file()
