"""Every chosen list and every tolerance in configs/*.yaml says which split it came from (issue 31).

A skip list, a keep list or a tolerance chosen on the data its gate then judges proves nothing, so each one must
say where it came from: `split: tuning (...)`, `split: validation (...)` (the honest truth for old choices) or
`split: none (a principle ...)`.

The rule (simple, on the file's text, no YAML comment round-tripping):
- Guarded keys: a list value anywhere under server.quant, server.fp16, server.bf16; a number or null (a
  tolerance) anywhere under server.gates, export.gate, lite.gate, system.gates, server.recommend, and
  bundle.sample_atol / sample_rtol / sample_prob_atol. Keys are found with yaml.compose, so a flow mapping
  (`int8: {metric_delta: 0.03}`) guards each of its numbers, all on that one line.
- A guarded key is annotated when the text `split:` appears in a comment on the key's own line, or on a
  comment-only line of the contiguous block of comment-only lines directly above the key's line, or on the line
  (or that block above it) of an enclosing key (so `gates:  # split: ...` covers the tolerances below it).
Not guarded: counts and seconds (batch_nums, sensitivity budgets), strings and booleans, train.min_metric (a
floor under the validation metric it is measured on, not a choice tuned against a gate).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
LIST_UNDER = ("server.quant", "server.fp16", "server.bf16")
NUMBER_UNDER = ("server.gates", "export.gate", "lite.gate", "system.gates", "server.recommend",
                "bundle.sample_atol", "bundle.sample_rtol", "bundle.sample_prob_atol")
NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:null")


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def guarded(node, path: str = "", lines: tuple[int, ...] = ()):
    """(dotted key, line of the key, lines of its enclosing keys) of every guarded key below node."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key, value in node.value:
        p = f"{path}.{key.value}" if path else str(key.value)
        line = key.start_mark.line
        if isinstance(value, yaml.MappingNode):
            yield from guarded(value, p, (*lines, line))
        elif isinstance(value, yaml.SequenceNode) and _under(p, LIST_UNDER):
            yield p, line, lines
        elif isinstance(value, yaml.ScalarNode) and value.tag in NUMBER_TAGS and _under(p, NUMBER_UNDER):
            yield p, line, lines


def _comment(text: str) -> str:
    """The comment part of a line ('' when none; a '#' inside a quoted value would count: none in configs/)."""
    i = text.find("#")
    return text[i:] if i >= 0 else ""


def annotated(src: list[str], line: int) -> bool:
    """`split:` in the comment of src[line] or in the comment-only lines directly above it."""
    if "split:" in _comment(src[line]):
        return True
    i = line - 1
    while i >= 0 and src[i].lstrip().startswith("#"):
        if "split:" in src[i]:
            return True
        i -= 1
    return False


def missing(path: Path) -> list[str]:
    src = path.read_text().splitlines()
    root = yaml.compose(path.read_text())
    return [f"{path.name}:{line + 1}: {key}" for key, line, parents in guarded(root)
            if not any(annotated(src, n) for n in (line, *parents))]


def test_rule_finds_guarded_keys_and_annotations():
    """The rule itself: a planted unannotated list fails, each kind of annotation passes."""
    import tempfile

    text = ("server:\n  quant:\n    skip: [a]\n    op_types: [conv2d]   # split: none (a principle)\n"
            "    batch_nums: 10\n  gates:\n    # split: tuning (calib.npz)\n    int8: {metric_delta: 0.03}\n"
            "export:\n  gate:   # split: none (parity)\n    atol: 1.0e-4\n")
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.yaml"
        p.write_text(text)
        assert missing(p) == ["x.yaml:3: server.quant.skip"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_list_and_tolerance_names_its_split(path: Path):
    bad = missing(path)
    assert not bad, ("list or tolerance without the split it came from (add `# split: tuning|validation|none (...)` "
                     "on its line or the comment block above; tests/test_config_splits.py):\n  " + "\n  ".join(bad))
