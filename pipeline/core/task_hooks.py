"""The optional task hooks (pipeline/tasks/base.py re-exports them): declared here, below the gates that ask for
them, so pipeline/core/gates.py asks `provides(task, hook)` instead of probing with hasattr."""
from __future__ import annotations

# hooks a task defines only when it has them (no neutral default exists): name -> what it does
OPTIONAL_HOOKS = {
    "correct_lost": "correct_lost(candidate, reference, labels) -> (lost, of): correctly read samples a candidate "
                    "loses; with labels, a text-reading task's rows are also gated on it (max_correct_lost)",
}


def provides(task, hook: str) -> bool:
    """Does `task` define the optional hook (OPTIONAL_HOOKS)? Asking for an undeclared hook is a bug."""
    if hook not in OPTIONAL_HOOKS:
        raise KeyError(f"{hook!r} is not an optional task hook (declared: {', '.join(OPTIONAL_HOOKS)})")
    return callable(getattr(task, hook, None))
