"""The README and docs/ as a user meets them: links resolve, every command they write exists, and the commands
that take minutes name the test or CI job that runs them."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")

# Commands the pages write that really run elsewhere, and what runs them (a test function or CI's entry point).
# The smoke-sized runs of those tests go through the same targets' code paths (`make X` = `python -m pipeline run X`).
# The benchmarks and the real-model runs (make bench-*, real-ocr, test-profiles, conformance over the whole zoo)
# take minutes to hours: no test runs them; test_every_make_target_written_exists checks them with `make -n`.
RUN_ELSEWHERE = {
    "make test": ".ci/run",
    "make train export deploy": "tests/test_chain.py::test_every_gate_passed",
    "make train": "tests/test_train.py::test_metrics_jsonl_has_every_field_per_epoch",
    "make deploy": "tests/test_chain.py::test_bundle_files_match_manifest",
    "make verify": "tests/test_bundle.py::test_verify_cli_passes_on_a_fresh_bundle",
    "make serve": "tests/test_serve.py::test_serve_a_real_bundle_folder_and_archive",
    "make nightly": "tests/test_nightly.py::test_default_task_nightly_accept_nightly",
    "make accept": "tests/test_nightly.py::test_default_task_nightly_accept_nightly",
    "make summary": "tests/test_bad_inputs.py::test_subprocess_case",
    "make conformance": "tests/test_zoo.py::test_conformance_fast_subset_end_to_end",
    "make test-ocr": "tests/test_ocr_chain.py::test_system_rows_and_bundle",
    "make fetch-ppocr": "tests/test_ppocr.py::test_real_det_on_a_real_page_in_its_own_frame",
    "make history": "tests/test_regression.py::test_check_run_junit_report_history_and_baselines",
    "python -m pipeline serve": "tests/test_ocr_chain.py::test_serve_cli_answers_ocr_on_the_system_bundle",
    "python -m pipeline verify": "tests/test_bundle.py::test_verify_cli_passes_on_a_fresh_bundle",
    "python -m pipeline run": "tests/test_chain.py::test_every_gate_passed",
}


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    body = FENCE.sub("", _text(page))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", body, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", _text(page)))


def commands(kind: str) -> set[str]:
    """`make <targets>` / `python -m pipeline <subcommand>` written in code spans and code blocks."""
    found = set()
    for page in PAGES:
        text = _text(page)
        code = [m.group(0) for m in FENCE.finditer(text)] + SPAN.findall(FENCE.sub("", text))
        for chunk in code:
            if kind == "make":
                for m in re.finditer(r"(?:^|[\s;(&|])make((?:\s+[a-z][a-z0-9-]*)+)", chunk, re.M):
                    found.update(m.group(1).split())
            else:
                found.update(re.findall(r"python -m pipeline\s+([a-z][a-z-]*)", chunk))
    return found


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([a-z][a-z0-9 -]*?):(?!=)", text, re.M):
        targets.update(m.group(1).split())
    return targets


def test_readme_is_a_front_door():
    lines = _text(ROOT / "README.md").splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move reference material into docs/"
    assert any(ln.startswith("Package order (bottom to top): ") for ln in lines)   # tests/test_structure.py reads it


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):          # http(s), mailto: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading '#{anchor}' in {dest.name})")
    assert not broken, f"{page.name}: broken links: {broken}"


# Pages other work is adding to docs/ while this README was written: linked from the README's table once they land;
# until then they may sit unlinked (any other page must be linked).
ANNOUNCED = {"bad_inputs.md", "untrusted_models.md", "low_precision.md", "serving_choice.md", "pir_import.md",
             "gates.md", "serving_hardening.md"}


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked and p.name not in ANNOUNCED]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_every_make_target_written_exists():
    written, real = commands("make"), makefile_targets()
    assert {"train", "export", "deploy", "test"} <= written
    missing = sorted(t for t in written if t not in real)
    assert not missing, f"`make` targets written in README/docs but not in the Makefile: {missing}"
    res = subprocess.run(["make", "-n", *sorted(written - {"setup", "clean"})], cwd=ROOT, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "BUNDLE": "x"}, timeout=60)
    assert "No rule to make target" not in res.stderr, res.stderr


def test_every_cli_subcommand_written_answers_help():
    from pipeline.cli import build_parser

    written = commands("pipeline")
    assert {"run", "serve", "verify"} <= written
    parser = build_parser()
    for sub in sorted(written):
        with pytest.raises(SystemExit) as done:
            parser.parse_args([sub, "--help"])
        assert done.value.code == 0, f"`python -m pipeline {sub} --help` exited {done.value.code}"


def test_the_help_of_the_real_entry_point():
    res = subprocess.run([sys.executable, "-m", "pipeline", "run", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "--quiet" in res.stdout and "--summary-json" in res.stdout, res.stderr


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    if not name:
        return True
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def test_commands_run_elsewhere_name_a_test_that_exists():
    missing = {cmd: ref for cmd, ref in RUN_ELSEWHERE.items() if not _test_exists(ref)}
    assert not missing, f"the test (or CI entry) running these commands is gone: {missing}"
    written = " ".join(_text(p) for p in PAGES)
    assert all(cmd in written for cmd in RUN_ELSEWHERE), \
        [cmd for cmd in RUN_ELSEWHERE if cmd not in written]        # the table maps commands the pages write
