# Device run (2 x H200), session 6, call A: the Trainer rows 1 GPU, FSDP2 and EP=2 x FSDP2 (both
# reshard_after_forward=false) in one run; then transformers + compile vs the Trainer with bf16 AdamW moments
# (like-for-like with torch's AdamW on bf16 parameters). Each part tees into $OUT.
source benchmarks/multigpu/device_setup.sh >/dev/null
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8"
echo "== Trainer: 1 GPU, FSDP2, EP2"; date
timeout 290 $T --row-timeout 110 --rows plait_trainer_compiled plait_trainer_fsdp2 plait_trainer_ep2 2>&1 \
  | tee $OUT/trainer_rows.log | grep -E "^plait|failed|^\|"
echo "== 1 GPU: transformers + compile vs Trainer with bf16 moments"; date
timeout 200 $T --row-timeout 140 --rows hf_compiled plait_trainer_compiled \
  --trainer-args="--optimizer.moment_dtype=bfloat16" 2>&1 | tee $OUT/hf_vs_trainer_bf16m.log | grep -E "^plait|^hf|failed|^\|"
date
