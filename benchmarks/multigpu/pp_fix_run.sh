# Device run (2 GPUs), session 3: the executor's NCCL tests (two tensors per message, every PP2 schedule) and
# the main job with PP2 (1F1B, ZBV, DualPipeV) on NCCL against its 1-GPU run, after the group pairing fix.
source benchmarks/multigpu/device_setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/pipelining 2>&1 | tail -15
timeout 300 python3 benchmarks/multigpu/layouts.py --gpus 2 --steps 10 --timeout 80 --skip-resume \
  --only "PP2 1F1B,PP2 ZBV,PP2 DualPipeV" --out $OUT/layouts.md > $OUT/layouts.log 2>&1; echo "layouts rc=$?"
grep -E "failed|TIMEOUT|Error|File \"$PWD" $OUT/layouts.log | head -30; cat $OUT/layouts.md
