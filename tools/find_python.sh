#!/usr/bin/env bash
# Print the path of a Python >= 3.12 (3.12 preferred: the GPU machine runs 3.12).
# Looks on PATH first, then under pyenv; exits 1 with a clear message if none.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
candidates=()
for name in python3.12 python3 python python3.13 python3.14; do
  p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done
candidates+=($(ls -d "$root"/versions/3.12*/bin/python3 2>/dev/null | sort -rV))
candidates+=($(ls -d "$root"/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -V))
for p in "${candidates[@]}"; do
  if ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: dropless needs Python >= 3.12; none found on PATH or under $root/versions." >&2
echo "Install one (e.g. 'pyenv install 3.12') or put python3.12 on PATH." >&2
exit 1
