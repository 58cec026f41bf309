#!/usr/bin/env bash
# Print a Python 3.10 interpreter: $PYTHON if given, else a working python3.10 on PATH,
# else the newest 3.10.* under $(pyenv root)/versions. paddlelite ships wheels only up to cp310.
set -euo pipefail
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 10) else 1)' >/dev/null 2>&1; }
if [[ -n "${PYTHON:-}" ]]; then
  if ok "$PYTHON"; then echo "$PYTHON"; exit 0; fi
  echo "error: PYTHON=$PYTHON is not a working Python 3.10 (paddlelite 2.13rc0 has wheels only up to cp310)" >&2
  exit 1
fi
if command -v python3.10 >/dev/null 2>&1 && ok python3.10; then command -v python3.10; exit 0; fi
root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
best="$(ls -d "$root"/versions/3.10.*/bin/python3.10 2>/dev/null | sort -V | tail -n1 || true)"
if [[ -n "$best" ]] && ok "$best"; then echo "$best"; exit 0; fi
echo "error: no Python 3.10 found (tried \$PYTHON, python3.10 on PATH, $root/versions/3.10.*)." \
     "Install one (e.g. 'pyenv install 3.10.13') or pass PYTHON=/path/to/python3.10" >&2
exit 1
