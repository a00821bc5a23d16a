#!/usr/bin/env bash
# The full-size benchmark (bench/device/fullsize.py) on a GPU machine: SD3.5-Medium, then FLUX.1-dev,
# then SD3.5-Large, then Qwen-Image, random weights from the published configs at their recipes' settings, bf16.
# Results (results.json, RESULTS.md) go to $OUT when the device tool sets it, else bench/device/;
# they are rewritten after each model, so a run stopped at its limit keeps what it measured.
# Needs torch with CUDA, diffusers, transformers, peft, accelerate, safetensors, pyarrow and typer
# importable (tpkit itself is imported from this checkout). About 2-4 minutes a model on an H100.
#   bash bench/device/fullsize.sh [--models sd35m flux]
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'fullsize.sh: no CUDA GPU here')"
export PYTHONUNBUFFERED=1
exec python3 bench/device/fullsize.py --models sd35m flux sd35l qwen --out "${OUT:-bench/device}" "$@"
