# Session 8, call B (nvidia-h200-x2, carry [".whl"]): timelines of the 1-GPU and FSDP2 Trainer steps and of
# compiled cp=2 at 32k (chrome traces in $OUT, read offline).
source benchmarks/multigpu/device_setup.sh >/dev/null
export PROFILE_TRACE_DIR=$OUT
echo "== Trainer profiles"; date
for row in plait_trainer_compiled plait_trainer_fsdp2; do
  timeout 110 python3 benchmarks/training/throughput.py --no-write --steps 8 --warmup 8 --row-timeout 100 --profile \
    --rows $row > $OUT/profile_$row.log 2>&1; grep -E "^plait|PROFILE (kernel|dynamo)" $OUT/profile_$row.log
done
echo "== CP compiled profile"; date
timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search none --compile --profile \
  2>&1 | tee $OUT/cp_profile.log | grep -E "^\||Error"
ls -la $OUT; date
