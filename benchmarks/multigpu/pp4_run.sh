# Device run (4 GPUs), session 3: the executor's NCCL tests at pp=4 (groups with two peers), and the main job
# with PP4 (1F1B, ZBV, DualPipeV) and PP2 x DP2 (FSDP2 stages) against its 1-GPU run.
source benchmarks/multigpu/device_setup.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/pipelining -k pp4 -rA 2>&1 | grep -E "PASSED|FAILED|passed|failed" | head -10
timeout 330 python3 benchmarks/multigpu/layouts.py --gpus 4 --steps 10 --timeout 70 --skip-resume \
  --only "PP4 1F1B,PP4 ZBV,PP4 DualPipeV,PP2 x DP2" --out $OUT/layouts.md > $OUT/layouts.log 2>&1; echo "layouts rc=$?"
grep -E "failed|TIMEOUT|Error" $OUT/layouts.log | head -10; cat $OUT/layouts.md
