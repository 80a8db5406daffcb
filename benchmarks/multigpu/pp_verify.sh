# Device run (2 GPUs): the main job with PP2 (1F1B, ZBV, DualPipeV) on NCCL vs 1 GPU, then every schedule
# of plait vs torch.distributed.pipelining.
source benchmarks/multigpu/device_setup.sh
timeout 240 python3 benchmarks/multigpu/layouts.py --gpus 2 --steps 10 --timeout 60 --skip-resume \
  --only "PP2 1F1B,PP2 ZBV,PP2 DualPipeV" --out $OUT/layouts.md > $OUT/layouts.log 2>&1; echo "layouts rc=$?"
grep -E "failed|TIMEOUT|Error|File \"$PWD" $OUT/layouts.log | head -20; cat $OUT/layouts.md
bash benchmarks/multigpu/with_stacks.sh 200 $OUT/schedules.log torchrun --standalone --nproc-per-node 2 \
  benchmarks/pipelining/schedules.py --batch 32 --seq 2048 --microbatches 8
echo "schedules rc=$?"; grep -E "^\||TFLOP|one layers|Error|TIMEOUT" $OUT/schedules.log
