# Session 8, call D (nvidia-h200-x2, carry [".whl"]): the 2-GPU Trainer rows with their new FSDP units
# against the 1-GPU row (same run), gpu2.toml's main job for 3 steps, and the multigpu tests.
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== throughput"; date
timeout 200 python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 100 \
  --rows plait_trainer_compiled plait_trainer_fsdp2 plait_trainer_ep2 2>&1 | tee $OUT/throughput.log | grep -E "^plait|failed|^\|"
echo "== gpu2.toml, 3 steps"; date
timeout 110 torchrun --standalone --nproc-per-node 2 examples/qwen3_moe/pretrain.py --config examples/qwen3_moe/configs/gpu2.toml \
  --steps 3 --run-dir /tmp/gpu2run --no-export --logging.interval=1 --logging.progress_bar=false --checkpoint.enabled=false \
  > $OUT/gpu2.log 2>&1; echo "rc=$?"; grep -E "step|loss|Error" $OUT/gpu2.log | tail -5
echo "== multigpu tests"; date
timeout 170 python3 -m pytest -q -p no:cacheprovider -m multigpu tests --tb=short -rfE > $OUT/multigpu.log 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/multigpu.log | cut -c1-250 | tail -8
date
