# Device run (2 GPUs): the main job PP2 1F1B on NCCL vs 1 GPU, async checkpoint saved on 2 GPUs and resumed
# on 1; the 1B-parameter async-save stall benchmark (1 GPU); a profiled 1F1B step of plait and torch.
source benchmarks/multigpu/device_setup.sh
timeout 250 python3 benchmarks/multigpu/layouts.py --gpus 2 --steps 10 --timeout 70 --only "PP2 1F1B" \
  --out $OUT/layouts.md > $OUT/layouts.log 2>&1; echo "layouts rc=$?"
grep -E "failed|TIMEOUT|Error|File \"$PWD" $OUT/layouts.log | head -30; cat $OUT/layouts.md
timeout 230 python3 benchmarks/checkpoint/async_save.py --params-b 1.0 --saves 3 > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$?"; grep -v Warn $OUT/checkpoint.log | tail -8
bash benchmarks/multigpu/with_stacks.sh 90 $OUT/sched.log torchrun --standalone --nproc-per-node 2 \
  benchmarks/pipelining/schedules.py --schedules 1f1b --steps 3 --warmup 1 --trace-dir /tmp/trace
echo "sched rc=$?"; grep -E "^\||one layers" $OUT/sched.log
mkdir -p $OUT/trace && for f in /tmp/trace/*.json; do gzip -c $f > $OUT/trace/$(basename $f).gz; done; ls -la $OUT/trace
