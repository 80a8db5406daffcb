# Device run (2 GPUs), session 3, second: the executor's NCCL tests per schedule, the main job with PP2 ZBV and
# DualPipeV against its 1-GPU run (after the split-backward keep-alive fix), and the schedules benchmark.
source benchmarks/multigpu/device_setup.sh
timeout 130 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/pipelining > $OUT/pytest.log 2>&1
grep -E "passed|failed|PASS|FAIL|Error" $OUT/pytest.log | tail -12
timeout 200 python3 benchmarks/multigpu/layouts.py --gpus 2 --steps 10 --timeout 70 --skip-resume \
  --only "PP2 ZBV,PP2 DualPipeV" --out $OUT/layouts.md > $OUT/layouts.log 2>&1; echo "layouts rc=$?"
grep -E "failed|TIMEOUT|Error" $OUT/layouts.log | head -10; cat $OUT/layouts.md
bash benchmarks/multigpu/with_stacks.sh 220 $OUT/schedules.log torchrun --standalone --nproc-per-node 2 \
  benchmarks/pipelining/schedules.py --batch 32 --seq 2048 --microbatches 8
echo "schedules rc=$?"; grep -E "^\||^- |TFLOP|hidden|Error|TIMEOUT" $OUT/schedules.log
