"""Write docs/bad_inputs.md from the corpus in tests/bad_inputs_cases.py (tests check it is current)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import bad_inputs_cases

out = ROOT / "docs" / "bad_inputs.md"
out.write_text(bad_inputs_cases.table())
print(f"wrote {out} ({len(bad_inputs_cases.ALL)} cases)")
