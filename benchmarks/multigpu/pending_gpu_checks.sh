# GPU runs owed by session 8 (what its device time did not cover). Run on nvidia-h200-x2 (with carry [".whl"];
# logs and traces in $OUT; ~8 min):   bash benchmarks/multigpu/pending_gpu_checks.sh
# 1. Why cp=2's collectives wait (issue 20 follow-up): both ranks' timelines of compiled cp=2 at 32k.
# 2. Issue 18's 1.3x target, last measured in session 6: transformers + compile against plait's compiled Trainer
#    (fp32 and bf16 moments), same run.
# 3. Issue 22's 2-GPU scaling figures with the FSDP units of session 8 (results/scaling.md predates them).
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== CP traces, both ranks"; date
PROFILE_TRACE_DIR=$OUT timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py \
  --search none --compile --profile 2>&1 | tee $OUT/cp_profile.log | grep -E "^\||Error"
echo "== transformers + compile vs plait"; date
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 120"
timeout 150 $T --rows hf_compiled plait_trainer_compiled 2>&1 | tee $OUT/hf.log | grep -E "^plait|^hf|failed"
timeout 80 $T --rows plait_trainer_compiled --trainer-args="--optimizer.moment_dtype=bfloat16" 2>&1 \
  | tee $OUT/bf16_moments.log | grep -E "^plait|failed"
echo "== scaling, 2 GPUs"; date
timeout 200 python3 benchmarks/multigpu/scaling.py --gpus 2 --out $OUT/scaling.md 2>&1 | tail -8
date
