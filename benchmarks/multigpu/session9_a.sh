# Session 9, call A (nvidia-h200-x2, carry [".whl"]): where the GPU time goes in transformers + compile and in
# plait's compiled 1-GPU and EP=2 Trainer steps (kernel tables, rank-0 chrome traces), and both ranks' timelines
# of compiled cp=2 at 32k (session 8's open question). Logs and traces in $OUT.
source benchmarks/multigpu/device_setup.sh >/dev/null
export PROFILE_TRACE_DIR=$OUT
echo "== profiles"; date
for row in hf_compiled plait_trainer_compiled plait_trainer_ep2; do
  timeout 130 python3 benchmarks/training/throughput.py --no-write --steps 8 --warmup 8 --row-timeout 120 --profile \
    --rows $row > $OUT/profile_$row.log 2>&1; grep -E "^plait|^hf|failed|PROFILE (kernel|dynamo)" $OUT/profile_$row.log
done
echo "== CP compiled profile, both ranks"; date
timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search none --compile --profile \
  2>&1 | tee $OUT/cp_profile.log | grep -E "^\||Error"
ls -la $OUT; date
