#!/usr/bin/env bash
# Set up if needed, then run the tests (extra args go to pytest).
#   scripts/test.sh          the default suite: everything not marked `slow`
#   scripts/test.sh --all    every test, the slow end-to-end ones included (CI runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ "${1:-}" == "--all" ]]; then
    shift
    exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -m "not slow" "$@"
