#!/usr/bin/env bash
# One prepared run on a lent GPU machine (tool `device`, 15 minutes a session), from the repo root:
#   1. imports, GPU and versions -> $OUT/gpu.txt (the machine's own torch; tpkit's other needs
#      travel as wheels in .whl/, made here by `bash bench/device/fetch_wheels.sh` and named in the
#      call's carry)
#   2. the TP-GRPO shapes recipe on CUDA in bf16 (dtype auto), 2 rounds with held-out evaluation
#      before and after -> $OUT/bf16.log, bf16-rounds.jsonl, bf16-report.png
#   2b. the same 2 rounds with the shapes detector spread over 8 processes (reward option workers;
#      score is CPU-bound there) -> $OUT/pool.log, pool-rounds.jsonl: compare the score seconds per
#      round with step 2's (same seeds: the rewards, hence the rounds' numbers, must be identical)
#   3. bench/shapes/tune_shapes.py's settings on the validation split in float32, 8 runs side by side,
#      seed by seed, cut at SWEEP_S seconds -> $OUT/sweep.log, sweep.tgz (rounds.jsonl, run.toml,
#      manifests (eval-base's holds the base model's accuracy) and logs)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SWEEP_S=${SWEEP_S:-300}
SEEDS=${SEEDS:-0 1 2 3}
SMOKE=${SMOKE:-1}  # 0: skip step 2
POOL=${POOL:-1}  # 0: skip step 2b
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch, diffusers, transformers, peft, accelerate, webdataset, tpkit
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'diffusers', diffusers.__version__,
      'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if [ "$SMOKE" = 1 ]; then
t0=$(date +%s)
timeout 180 python3 -m tpkit run pipelines/shapes-tpgrpo.toml --out /tmp/bf16 --rounds 2 --set eval_every=2 \
  > "$OUT/bf16.log" 2>&1; echo "bf16 smoke: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
cp /tmp/bf16/rounds.jsonl "$OUT/bf16-rounds.jsonl" 2>/dev/null; cp /tmp/bf16/report.png "$OUT/bf16-report.png" 2>/dev/null
tail -25 "$OUT/bf16.log"
fi
if [ "$POOL" = 1 ]; then
t0=$(date +%s)
timeout 180 python3 -m tpkit run pipelines/shapes-tpgrpo.toml --out /tmp/pool --rounds 2 --set eval_every=2 \
  --set rewards.geneval.workers=8 > "$OUT/pool.log" 2>&1; echo "pool: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
cp /tmp/pool/rounds.jsonl "$OUT/pool-rounds.jsonl" 2>/dev/null
tail -15 "$OUT/pool.log"
fi

t0=$(date +%s)
timeout "$SWEEP_S" python3 bench/shapes/tune_shapes.py --seeds $SEEDS --rounds 9 --jobs 8 --runs /tmp/tune --out /tmp/tune-out \
  --settings recipe strict-mix std-global strict-mix-std-global group16 noise1.0 prompts32 lr2e-3 \
  --set rollout.dtype=float32 --set score.dtype=float32 --set train.dtype=float32 --set eval.dtype=float32 \
  > "$OUT/sweep.log" 2>&1; echo "sweep: exit $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
sleep 2
(cd /tmp && find tune \( -name rounds.jsonl -o -name '*.log' -o -name 'fit.jsonl' -o -name 'val.jsonl' \
   -o -name manifest.json -o -name run.toml \) -print0 | tar czf "$OUT/sweep.tgz" --null -T -)
cp /tmp/tune-out/RESULTS.md "$OUT/" 2>/dev/null
tail -40 "$OUT/sweep.log"
