# Session 9, call B (nvidia-h200-x2, carry [".whl"]): does chunking the all-gather EP dispatch overlap its
# collectives with the experts once compiled? The MoE layer alone (compiled, with and without Inductor's comm
# reordering; rank-0 traces), then the EP=2 Trainer row with expert_chunks 1 and 2 against the 1-GPU row.
source benchmarks/multigpu/device_setup.sh >/dev/null
python3 -c "import torch._inductor.config as c; print('simple_overlap', getattr(c.aten_distributed_optimizations, 'enable_simple_overlap', 'absent'))"
echo "== MoE layer, compiled"; date
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_overlap.py --compile --chunks 2 4 \
  --profile $OUT/layer 2>&1 | tee $OUT/layer_compiled.log | grep -E "^\||Error"
echo "== MoE layer, compiled, Inductor comm reordering"; date
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_overlap.py --compile --inductor-overlap \
  --chunks 2 4 2>&1 | tee $OUT/layer_compiled_reorder.log | grep -E "^\||Error"
echo "== Trainer rows"; date
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 100"
timeout 120 $T --rows plait_trainer_compiled plait_trainer_ep2 2>&1 | tee $OUT/tp_1.log | grep -E "^plait|failed"
timeout 100 $T --rows plait_trainer_ep2 --trainer-args="--parallel.expert_chunks=2" 2>&1 | tee $OUT/tp_2.log | grep -E "^plait|failed"
ls $OUT/layer; date
