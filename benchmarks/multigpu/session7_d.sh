# Device run (2 x H200), session 7, call D (after the padded all-to-all was replaced by all_gather):
# the all-gather dispatch's NCCL tests; EP2 x FSDP2 Trainer rows with the exact all-to-all and all_gather in
# one run next to the 1-GPU row (1.14B model); issue 22's scaling rows on 2 GPUs again (gpu1.toml's model,
# EP row now all_gather).
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== tests"; date
timeout 80 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/moe/test_expert_parallel.py -k all_gather \
  --tb=short -rfE > $OUT/tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 100"
echo "== Trainer rows, 1.14B"; date
timeout 150 $T --rows plait_trainer_compiled plait_trainer_ep2 2>&1 | tee $OUT/rows.log | grep -E "^plait|failed"
timeout 80 $T --rows plait_trainer_ep2 --trainer-args=--parallel.expert_dispatch=all_to_all 2>&1 \
  | tee $OUT/rows_exact.log | grep -E "^plait|failed"
echo "== scaling"; date
timeout 230 python3 benchmarks/multigpu/scaling.py --gpus 2 --out $OUT/scaling.md 2>&1 | tee $OUT/scaling.log \
  | grep -E "^plait|failed|Error"
cat $OUT/scaling.md; date
