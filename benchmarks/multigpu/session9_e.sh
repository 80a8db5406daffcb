# Session 9, call E (nvidia-h200-x2, carry [".whl"]): the final figures of this session's code on one machine:
# transformers + compile against the compiled Trainer (one-pass linear cross-entropy), the FSDP2 and EP=2 rows,
# the Trainer with bf16 moments, then issue 22's 2-GPU scaling part with session 8's FSDP units.
source benchmarks/multigpu/device_setup.sh >/dev/null
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 150"
echo "== throughput"; date
timeout 280 $T --rows hf_compiled plait_trainer_compiled plait_trainer_fsdp2 plait_trainer_ep2 2>&1 \
  | tee $OUT/throughput.log | grep -E "^plait|^hf|failed|timed out"
timeout 55 $T --rows plait_trainer_compiled --trainer-args="--optimizer.moment_dtype=bfloat16" 2>&1 \
  | tee $OUT/bf16_moments.log | grep -E "^plait|failed|timed out"
echo "== scaling, 2 GPUs (issue 22 part e)"; date
timeout 195 python3 benchmarks/multigpu/scaling.py --gpus 2 --row-timeout 70 --out $OUT/scaling_e.md > $OUT/scaling_e.log 2>&1
echo "rc=$?"; cat $OUT/scaling_e.md; date
