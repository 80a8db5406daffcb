# Device run (2 x H200), session 4: this round's multi-GPU tests, the 2-GPU throughput rows (FSDP2, EP2
# next to the 1-GPU row), the expert-parallel overlap benchmark and the long-context (CP) benchmark.
source benchmarks/multigpu/device_setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "multigpu or gpu" tests/pipelining/test_schedule_sizes.py \
  tests/models/test_context_parallel.py tests/moe/test_expert_parallel.py tests/models/test_compile.py --tb=line 2>&1 \
  | grep -E "^/|Error|passed|failed" | head -20 | tee $OUT/tests.log
timeout 180 python3 benchmarks/training/throughput.py --no-write --steps 20 --warmup 10 --row-timeout 110 \
  --rows plait_trainer_compiled plait_trainer_fsdp2 plait_trainer_ep2 > $OUT/tp2.log 2>&1; grep -E "^\||failed" $OUT/tp2.log
timeout 70 torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_overlap.py --markdown $OUT/ep_overlap.md \
  > $OUT/ep.log 2>&1; tail -10 $OUT/ep.log
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --max-seq 262144 \
  --granularity 16384 --timeout 120 --markdown $OUT/long_context.md > $OUT/cp.log 2>&1; tail -14 $OUT/cp.log
