# Session 9, call C (nvidia-h200-x2, carry [".whl", "_base"]): this session's code against session 8's (b1d7b84,
# unpacked in _base by `git archive b1d7b84 packages examples benchmarks/training | tar -x -C _base`) on the
# same machine: the 1-GPU, FSDP2 and EP=2 Trainer rows (call B measured EP=2 at 0.47x of 1 GPU after the
# one-pass linear cross-entropy landed); then transformers + compile against the Trainer with bf16 moments.
source benchmarks/multigpu/device_setup.sh >/dev/null
T="benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 100"
echo "== new"; date
timeout 170 python3 $T --rows plait_trainer_compiled plait_trainer_ep2 plait_trainer_fsdp2 2>&1 | tee $OUT/new.log | grep -E "^plait|failed"
echo "== session 8 (b1d7b84)"; date
(cd _base && PYTHONPATH=/tmp/site timeout 120 python3 $T --rows plait_trainer_compiled plait_trainer_ep2 2>&1 | tee $OUT/base.log | grep -E "^plait|failed")
echo "== transformers + compile vs plait (bf16 moments)"; date
timeout 150 python3 $T --rows hf_compiled plait_trainer_compiled --trainer-args="--optimizer.moment_dtype=bfloat16" 2>&1 \
  | tee $OUT/hf.log | grep -E "^plait|^hf|failed"
echo "== new EP=2 row, profiled (rank-0 trace)"; date
PROFILE_TRACE_DIR=$OUT timeout 100 python3 $T --steps 8 --profile --rows plait_trainer_ep2 > $OUT/profile_ep2.log 2>&1
grep -E "^plait|failed|PROFILE (kernel|dynamo|host)" $OUT/profile_ep2.log
date
