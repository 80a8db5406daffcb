# Device run C (4 GPUs): async-checkpoint stall benchmark, then a few layouts with generous timeouts.
source benchmarks/multigpu/device_setup.sh
timeout 120 python3 benchmarks/checkpoint/async_save.py --params-b 1.0 --saves 2 > $OUT/checkpoint.md 2>&1; tail -6 $OUT/checkpoint.md
timeout 340 python3 benchmarks/multigpu/layouts.py --gpus 4 --steps 20 --timeout 50 --out $OUT/layouts.md \
  --only "FSDP4,HSDP 2x2,PP2 1F1B" > $OUT/layouts.log 2>&1
grep -E "File \"/work|Error|Thread|^\('" $OUT/layouts.log | head -40
cat $OUT/layouts.md
