"""How `make conformance` judges its rows: near-chance models, gates that cannot resolve their limit, the exit code.

One rule for near chance: a low-precision row (fp16/bf16/int8) compares its metric, agreement and lost lines with
the fp32 row's, and a model that scores near chance has no decisions for low precision to keep or change: its pass
means nothing and so does its failure. Such a row is MARKED whatever its verdict would be (the verdict it would
have had is kept in `would_be`, with its reason), counted apart, and too many marked rows fail the run: then the zoo
proves nothing. fp32 rows are exact parity (metric_delta 0, no line may be lost, 1e-4 elementwise) and judge the
engine on any weights: they always count.

Resolution: on n samples a metric moves in steps of 1/n, and a lost-correct-lines share in steps of 1/(correctly
read samples). A gate resolves its limit when one sample moves it by at most limit/RESOLUTION, and, for lost lines
and agreement, when the 95 % (Wilson) interval of the observed share leaves the limit out: k of n lost is a draw, and a row whose true
rate sits at the limit fails on about half of the slices it could be judged on (svtr_lcnet's int8 rows, 19 and 23 of
336 lost on the gate slice, 4.1 % and 4.9 % of 1358 on a fresh one: docs/conformance.md). Otherwise the row says so
(its verdict stands: it is what the gate decided, on too few samples to be sharp).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

HEADROOM = 5            # fp32 metric must stand HEADROOM x the loosest low-precision metric_delta above chance
RESOLUTION = 4          # a gate resolves limit L when one sample moves its observed value by at most L / 4
LOW_PRECISIONS = ("fp16", "bf16", "int8")
MARKED = "MARKED"
EXECUTED = ("OK", "FAIL", "EXCLUDED", MARKED)     # rows that ran and judged (SKIPPED/UNVERIFIED/NOT RUN did not)
PASSING = ("OK", "SKIPPED", "UNVERIFIED", "EXCLUDED")   # SKIPPED/UNVERIFIED carry their reason; EXCLUDED: a candidate


@dataclass
class Row:
    arch: str
    row: str                 # "<stage>: <subject>"
    verdict: str             # OK | FAIL | EXCLUDED | MARKED | SKIPPED | UNVERIFIED (converted, not executed) | NOT RUN
    observed: str = ""
    limit: str = ""
    seconds: float | None = None
    note: str = ""
    would_be: str = ""       # MARKED rows: the verdict the gate gave
    unresolved: bool = False  # a metric/lost-lines check on too few samples to resolve its limit


@dataclass
class Standing:
    """An architecture's fp32 metric against chance + HEADROOM x its metric budget (the loosest low-precision
    metric_delta)."""
    metric: str
    fp32: float
    chance: float
    budget: float

    @property
    def floor(self) -> float:
        return self.chance + HEADROOM * self.budget

    @property
    def margin(self) -> float:
        return self.fp32 - self.floor

    @property
    def near_chance(self) -> bool:
        return not math.isfinite(self.fp32) or self.fp32 < self.floor - 1e-12

    def reason(self) -> str:
        return (f"near chance: fp32 {self.metric} {self.fp32:.3f} < chance {self.chance:.3f} + {HEADROOM} x metric_delta "
                f"{self.budget:g} = {self.floor:.3f}; a model this close to chance has no decisions for low precision "
                "to keep or change, so this row's verdict means nothing (train it further to count it)")

    def line(self) -> str:
        return (f"fp32 {self.metric} {self.fp32:.3f}, chance {self.chance:.3f}, floor {self.floor:.3f} "
                f"(+{HEADROOM} x {self.budget:g}), margin {self.margin:+.3f}")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def resolved_config(run_dir: Path) -> dict:
    import yaml

    path = run_dir / "config.resolved.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def chance(run_dir: Path) -> float:
    """The primary metric of a model that guesses: 1/classes when the task names classes (classification, text
    direction), else 0 (a CTC line or a detection page is never right by chance)."""
    info = read_json(run_dir / "train" / "info.json")
    labels = (info.get("labels_info") or {}).get("labels") or []
    return 1.0 / len(labels) if info.get("task") in ("classification", "text_direction") and labels else 0.0


def server_manifest(run_dir: Path) -> dict:
    from pipeline.core.artifacts import load_manifest

    return load_manifest(run_dir / "server") or load_manifest(run_dir / "server.failed") or {}


def standing(run_dir: Path) -> Standing | None:
    """None when the run has no Paddle Inference fp32 row with a reference metric, or no low-precision gates."""
    fp32 = next((g for g in server_manifest(run_dir).get("gates", []) if g["subject"] == "paddle-inference fp32"), None)
    gates = (resolved_config(run_dir).get("server") or {}).get("gates", {})
    deltas = [float(gates[p]["metric_delta"]) for p in LOW_PRECISIONS if p in gates]
    if fp32 is None or fp32.get("reference") is None or not deltas:
        return None
    return Standing(fp32["metric"], float(fp32["reference"]), chance(run_dir), max(deltas))


def mark(verdict: str, note: str, precision: str, near: Standing | None) -> tuple[str, str, str]:
    """(verdict, note, would_be) of a gated row: a low-precision row that judged (OK, FAIL, EXCLUDED) of a model near
    chance is MARKED, its gate's verdict and reason kept."""
    if near is None or not near.near_chance or precision not in LOW_PRECISIONS or verdict not in ("OK", "FAIL", "EXCLUDED"):
        return verdict, note, ""
    was = f"would be {verdict}" + (f": {note}" if note else "")
    return MARKED, f"{near.reason()} ({was})", verdict


def _config_value(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


_OF = re.compile(r"(\d+) of (\d+) correctly read samples")
_ONE_OF = re.compile(r"one sample of (\d+)")


def _samples(gate: dict, check: dict, samples: int) -> int:
    """How many samples one step of this check is made of: the correctly read ones for lost lines, else the gated
    ones (the HTTP row judges only its requests, server.http.max_requests)."""
    detail = check.get("detail", "")
    if check["name"] == "correct_lost":
        m = _OF.search(detail)
        return int(m.group(2)) if m else round(float(gate.get("reference") or 0) * samples)
    m = _ONE_OF.search(detail)
    return int(m.group(1)) if m else int((gate.get("extra") or {}).get("requests") or samples)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % interval of a share k/n (Wilson: sound at k = 0 and at small n)."""
    if n <= 0:
        return 0.0, 1.0
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


def _draw(name: str, k: int, n: int, limit: float) -> str:
    """"" unless the share k/n's 95 % interval holds the limit: then this sample cannot tell the row from one at its
    limit, whichever side the observed share fell on."""
    lo, hi = wilson(k, n)
    if not lo < limit < hi:
        return ""
    return (f"{name} {k} of {n} = {k / n:.3f} could not resolve its limit {limit:g}: its 95 % interval "
            f"{lo:.3f}-{hi:.3f} holds the limit, so this slice cannot tell the row from one at its limit "
            "(a larger slice, data.num_val and train.val_slice, can)")


def _share(gate: dict, check: dict, samples: int) -> tuple[int, int] | None:
    """(k, n) of a lost-lines check ("k of n correctly read samples") or an agreement check (its share of n)."""
    if check["name"] == "correct_lost":
        m = _OF.search(check.get("detail", ""))
        return (int(m.group(1)), int(m.group(2))) if m else None
    n = _samples(gate, check, samples)
    return (round(float(check["observed"]) * n), n) if "agreement" in check["name"] and n else None


def resolution(gate: dict, samples: int, cfg: dict) -> str:
    """"" when every metric-drop, lost-correct-lines and agreement check of an executed gate resolves its configured
    limit (drops and lost lines by their step; lost lines and agreement by their 95 % interval), else why not.
    samples: the gated sample count (train's val_slice)."""
    notes = []
    for c in gate.get("checks", []):
        is_drop, is_lost, is_agree = c["name"].endswith("_drop"), c["name"] == "correct_lost", "agreement" in c["name"]
        if not (is_drop or is_lost or is_agree) or c.get("observed") is None:
            continue
        limit = _config_value(cfg, c["key"]) if c.get("key") else None
        limit = float(limit if limit is not None else c["limit"] or 0.0)
        if limit <= 0:
            continue                          # 0 is exact: any one sample fails it
        n = _samples(gate, c, samples)
        need = math.ceil(RESOLUTION / limit - 1e-9)
        if not is_agree and n < need:
            what = "correctly read samples" if is_lost else "samples"
            notes.append(f"{c['name']} could not resolve its limit {limit:g}: one of {n} {what} moves it by "
                         f"{1 / max(n, 1):.3g}, resolving {limit:g} needs >= {need} (1/(limit/{RESOLUTION}))")
        elif (is_lost or is_agree) and (share := _share(gate, c, samples)) and (draw := _draw(c["name"], *share, limit)):
            notes.append(draw)
    return "; ".join(notes)


def verdict_counts(rows: list[Row]) -> dict[str, int]:
    """Executed-and-passed apart from what never executed: a SKIPPED or UNVERIFIED row is not a pass, nor a MARKED
    one (a low-precision row of a model near chance, whatever its gate decided)."""
    rows = [r for r in rows if r.row != "chain (wall time)"]        # a summary of the others, not a row
    count = lambda *v: sum(r.verdict in v for r in rows)
    return {"executed OK": count("OK"), "marked (near chance)": count(MARKED),
            "marked that would fail": sum(r.verdict == MARKED and r.would_be != "OK" for r in rows),
            "excluded (candidate)": count("EXCLUDED"), "skipped": count("SKIPPED"), "unverified": count("UNVERIFIED"),
            "failed": count("FAIL"), "not run": count("NOT RUN"),
            "unresolved limit": sum(r.unresolved and r.verdict in EXECUTED for r in rows)}


def counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items())


def verdict(counts: dict[str, int], max_marked_share: float) -> tuple[int, str]:
    """(exit code, why it is not 0): a failed or not-run row, or more than max_marked_share of executed rows
    MARKED (then the zoo judges too little to prove anything)."""
    executed = counts["executed OK"] + counts["marked (near chance)"] + counts["excluded (candidate)"] + counts["failed"]
    share = counts["marked (near chance)"] / executed if executed else 0.0
    why = []
    if counts["failed"] or counts["not run"]:
        why.append(f"{counts['failed']} failed, {counts['not run']} not run")
    if share > max_marked_share + 1e-12:
        why.append(f"{counts['marked (near chance)']} of {executed} executed rows MARKED near chance ({share:.1%} > "
                   f"conformance.max_marked_share {max_marked_share:.1%}): train those architectures past chance")
    return (1 if why else 0), "; ".join(why)
