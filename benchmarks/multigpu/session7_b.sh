# Device run (2 x H200), session 7, call B: issue 22's scaling rows on 2 GPUs (1 GPU, FSDP2, EP2 x FSDP2 with
# the padded dispatch, PP2 1F1B), then a profile of the EP2 row (where its step time goes).
# (At commit 8383d68 throughput.py's EP rows used the padded all-to-all dispatch, since replaced by all_gather.)
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== scaling"; date
timeout 330 python3 benchmarks/multigpu/scaling.py --gpus 2 --out $OUT/scaling.md 2>&1 | tee $OUT/scaling.log \
  | grep -E "^plait|failed|Error"
cat $OUT/scaling.md
echo "== EP2 profile"; date
timeout 150 python3 benchmarks/training/throughput.py --no-write --steps 8 --warmup 8 --row-timeout 140 \
  --rows plait_trainer_ep2 --profile 2>&1 | tee $OUT/ep2_profile.log | grep -E "^plait|PROFILE|failed" | head -40
date
