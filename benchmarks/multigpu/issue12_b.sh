# Device run B (4 GPUs): the remaining layouts (PP stacks dumped on a hang), then single/multi-GPU benchmarks.
source benchmarks/multigpu/device_setup.sh
timeout 330 python3 benchmarks/multigpu/layouts.py --gpus 4 --steps 20 --timeout 45 --out $OUT/layouts.md \
  --only "FSDP4,HSDP 2x2,DP2 x TP2,PP2 1F1B,PP4 ZBV" > $OUT/layouts.log 2>&1
grep -A40 "failed" $OUT/layouts.log | grep -E "File|Error|line" | head -40
cat $OUT/layouts.md
timeout 60 python3 benchmarks/moe/moe_layer.py --markdown $OUT/moe_layer.md > $OUT/moe_layer.log 2>&1; tail -12 $OUT/moe_layer.log
timeout 60 torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_all_to_all.py --markdown $OUT/moe_ep2.md > $OUT/moe_ep2.log 2>&1; tail -8 $OUT/moe_ep2.log
timeout 90 python3 benchmarks/checkpoint/async_save.py --params-b 1.0 > $OUT/checkpoint.md 2>&1; tail -8 $OUT/checkpoint.md
