#!/usr/bin/env bash
# Build or update the linvit_mm environment (see tools/setup_env.py); needs Python 3.11.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${LINVIT_PYTHON:-}"
if [ -z "$py" ]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      py="$candidate"; break
    fi
  done
fi
if [ -z "$py" ]; then
  echo "setup_env: step \"preflight\" failed: no Python 3.11 found (tried python3.11, python3," \
       "python; set LINVIT_PYTHON to its path). The torch 2.14.1 wheels this stack pins are cp311." >&2
  exit 1
fi
exec "$py" "$here/setup_env.py" "$@"
