# Device run (2 x H200), session 5: the 1-GPU and FSDP2 Trainer rows after this session's host-side changes
# (FSDP2 with reshard_after_forward=false), fsdp.gather_once_per_step off/on at 4 microbatches per GPU,
# and the long-context search with the compiled block mask (allgather attention).
source benchmarks/multigpu/device_setup.sh >/dev/null
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 100"
timeout 160 $T --rows plait_trainer_compiled plait_trainer_fsdp2 --trainer-args="--parallel.reshard_after_forward=false" \
  2>&1 | tee $OUT/tp.log | grep -E "^plait|failed"
for g in false true; do
  timeout 105 $T --rows plait_trainer_fsdp2 --trainer-args="--batching.microbatch_size=1 --fsdp.gather_once_per_step=$g" \
    2>&1 | tee $OUT/gather_once_$g.log | grep -E "^plait|failed"
done
timeout 190 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search-from 262144 \
  --granularity 65536 --max-seq 655360 --timeout 120 --markdown $OUT/long_context.md 2>&1 | tee $OUT/cp.log \
  | grep -E "^cp=|^\||Longest|Error"
