"""The gate limits the docs state come from configs/defaults.yaml (issue 46): the generated table (`python -m pipeline
gates`) in docs/ is what the defaults give today, and the per-precision table of docs/low_precision.md states the
defaults' numbers."""
import re
from pathlib import Path

import pytest

from pipeline.core.config import load_config
from pipeline.core.gate_table import BEGIN, block_in, markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


@pytest.fixture(scope="module")
def defaults():
    return load_config([])


def test_the_generated_table_is_in_the_docs_and_current(defaults):
    want = markdown(defaults)
    holders = [p for p in DOCS if BEGIN in p.read_text(encoding="utf-8")]
    assert ROOT / "docs" / "stages.md" in holders
    for p in holders:
        assert block_in(p.read_text(encoding="utf-8")) == want, (
            f"{p.relative_to(ROOT)}: the gate table differs from configs/defaults.yaml; paste the output of "
            "`python -m pipeline gates` between its markers")


def test_the_table_follows_a_changed_default(defaults):
    changed = load_config([], ["server.gates.fp16.min_agreement=0.97"])
    assert markdown(changed) != markdown(defaults) and "| 0.97 |" in markdown(changed).split("server.gates.fp16")[1]


def test_low_precision_md_states_the_defaults(defaults):
    """Its text-gate table: one row per key, one column per precision, each number the default's."""
    text = (ROOT / "docs" / "low_precision.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| [^|]+ \| `(max_correct_lost|metric_delta|min_agreement)` \|((?: [^|]+ \|){4})", text, re.M)
    assert {k for k, _ in rows} == {"max_correct_lost", "metric_delta", "min_agreement"}
    for key, cells in rows:
        stated = [float(c.strip()) for c in cells.strip(" |").split("|")]
        want = [getattr(defaults.server.gates[p], key) or 0.0 for p in ("fp32", "fp16", "bf16", "int8")]
        assert stated == want, (key, stated, want)


def test_no_doc_states_another_agreement_or_drop_for_a_server_gate(defaults):
    """A line naming `server.gates.<p>` with "agreement ≥ N" or "drop ≤ N" states the default (not an old one)."""
    bad = []
    for p in DOCS:
        for line in p.read_text(encoding="utf-8").splitlines():
            m = re.search(r"`server\.gates\.(fp32|fp16|bf16|int8)`", line)
            if not m or "then-default" in line:
                continue
            tol = defaults.server.gates[m.group(1)]
            for what, key in (("agreement ≥ ", "min_agreement"), ("drop ≤ ", "metric_delta")):
                for n in re.findall(re.escape(what) + r"([0-9.]+)", line):
                    if float(n) != getattr(tol, key):
                        bad.append(f"{p.name}: {what}{n} for server.gates.{m.group(1)} (default {getattr(tol, key)})")
    assert not bad, bad
