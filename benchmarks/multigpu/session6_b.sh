# Device run (2 x H200), session 6, call B: the EP=2 x FSDP2 Trainer row under the profiler (kernel time,
# host syncs); DualPipeV greedy vs reference order on 2 GPUs against torch; context parallelism: tok/s per
# GPU at 32k (cp=2) vs 16k (cp=1), then one cp=2 trial at 606208 tokens (1.9x cp=1's longest, 311296).
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== EP2 profiled"; date
timeout 125 python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 115 \
  --rows plait_trainer_ep2 --profile 2>&1 | tee $OUT/ep2_profile.log | grep -E "PROFILE|^plait|failed" | head -20
sed -n "/Self CPU %/,/Self CUDA time total/p" $OUT/ep2_profile.log | cut -c1-60,120-230 | head -40
echo "== DualPipeV greedy vs reference, 2 GPUs"; date
timeout 120 torchrun --standalone --nproc-per-node 2 benchmarks/pipelining/schedules.py --batch 32 --seq 2048 \
  --microbatches 8 --schedules 1f1b,dualpipev,dualpipev_reference 2>&1 | tee $OUT/schedules_pp2.log \
  | grep -E "^\||^- |TFLOP|hidden|Error"
echo "== CP throughput"; date
timeout 140 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search none \
  --markdown $OUT/cp_throughput.md 2>&1 | tee $OUT/cp_throughput.log | grep -E "^cp=|^\||Longest|Error"
echo "== CP2 at 606208"; date
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search cp2 \
  --search-from 606208 --granularity 16384 --max-seq 606208 --timeout 100 --markdown $OUT/cp_longest.md 2>&1 \
  | tee $OUT/cp_longest.log | grep -E "^cp=|^\||Longest|Error"
date
