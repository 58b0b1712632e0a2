#!/usr/bin/env bash
# Set up and run the main job: the benchmark suite (CPU interpreter without a GPU; pass --gpu on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
setup_venv .venv bench
exec .venv/bin/prefixattn bench "$@"
