#!/usr/bin/env bash
# Wheels of what tpkit needs beyond the device image (torch, numpy, pyarrow, typer, rich ... are there),
# for bench/device/shapes_gpu.sh: run here, from the repo root, with the venv active; the device call
# then names .whl in its carry. .whl/ stays out of git through .git/info/exclude (about 25 MB).
set -eu
grep -qx "/.whl/" "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-dir)/info/exclude"
mkdir -p .whl
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# tpkit's own needs at the versions tested here, then theirs that the image lacks (or has too old)
for name in diffusers transformers huggingface_hub peft accelerate webdataset braceexpand tomli-w \
            httpx2 httpcore2 truststore kernels tomlkit click regex; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d .whl "$name==$(version "$name")"
done
ls .whl
