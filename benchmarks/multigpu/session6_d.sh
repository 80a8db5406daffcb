# Device run (2 x H200), session 6, call D: the compiled-layer CUDA tests (bf16 vs eager now by relative norm);
# one cp=1 trial at 312320 tokens (does cp=1 stop below 593920 / 1.9?); pytest -m multigpu on 2 GPUs; cp=2 ring throughput.
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== test_compile on CUDA"; date
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_compile.py --tb=short -rfE \
  > $OUT/compile_tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/compile_tests.log | cut -c1-300 | tail -8
echo "== cp=1 trial at 312320"; date
timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search cp1 \
  --search-from 312320 --granularity 1024 --max-seq 312320 --timeout 60 2>&1 | tee $OUT/cp1_trial.log \
  | grep -E "^cp=1 seq 3|Error" | head -3
echo "== pytest -m multigpu"; date
timeout 300 python3 -m pytest -q -p no:cacheprovider -m multigpu tests --tb=short -rfE > $OUT/multigpu_tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/multigpu_tests.log | cut -c1-250 | tail -15
date
echo "== CP throughput, ring"; date
timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search none --mode ring \
  --markdown $OUT/cp_ring.md 2>&1 | tee $OUT/cp_ring.log | grep -E "^\||Error"
date
