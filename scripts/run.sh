#!/usr/bin/env bash
# Set up if needed, then run laneserve on the embedded default model.
#   scripts/run.sh                      # the main job: an interactive chat that streams
#                                       # (without a terminal: one streamed chat answer)
#   scripts/run.sh serve                # any laneserve command and flags
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ] && [ -t 0 ]; then
  set -- chat
elif [ "$#" -eq 0 ]; then
  set -- generate --chat --max-tokens 128 "Explain in three sentences why the sky is blue."
fi
exec .venv/bin/laneserve "$@"
