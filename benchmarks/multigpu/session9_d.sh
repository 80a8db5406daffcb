# Session 9, call D (nvidia-h100-x1, carry [".whl", "_base"]): the one-pass linear cross-entropy (second version:
# one row kernel per chunk) on a GPU: its CUDA tests at real shapes, then the compiled Trainer with it against
# session 8's code (b1d7b84 in _base: the two-pass loss) on the same GPU, then transformers + compile against
# the Trainer (fp32 and bf16 moments).
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== gpu tests (kernels)"; date
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels --tb=short -rfE 2>&1 | tee $OUT/gpu_tests.log | tail -4
T="benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 100"
echo "== new"; date
timeout 100 python3 $T --rows plait_trainer_compiled 2>&1 | tee $OUT/new.log | grep -E "^plait|failed"
echo "== session 8 (b1d7b84)"; date
(cd _base && PYTHONPATH=/tmp/site timeout 100 python3 $T --rows plait_trainer_compiled 2>&1 | tee $OUT/base.log | grep -E "^plait|failed")
echo "== transformers + compile vs plait (bf16 moments)"; date
timeout 150 python3 $T --rows hf_compiled plait_trainer_compiled --trainer-args="--optimizer.moment_dtype=bfloat16" 2>&1 \
  | tee $OUT/hf.log | grep -E "^plait|^hf|failed"
date
