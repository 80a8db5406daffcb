# GPU runs owed by session 7 (built or wanted after its device time was spent). Run on nvidia-h200-x2:
#   bash benchmarks/multigpu/pending_gpu_checks.sh      (with carry [".whl"]; logs in $OUT; ~7 min)
# 1. Where cp=2's 32k step goes (issue 20: 0.61x of cp=1 at 32k): long_context.py --profile, cp=1 and cp=2.
# 2. Where the EP2 (all_gather) and FSDP2 Trainer steps go (issue 18: 0.51-0.63x and 0.70x of one GPU).
# 3. Context parallelism with full activation checkpointing on NCCL (a CPU-tested layout, not yet run on GPUs);
#    the all-gather EP dispatch's no-sync test again (its equal-token-count check was added after the last run).
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== CP profile"; date
timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search none --profile \
  2>&1 | tee $OUT/cp_profile.log | grep -E "^---|^\||Error"
T="python3 benchmarks/training/throughput.py --no-write --steps 8 --warmup 8 --row-timeout 140 --profile"
echo "== Trainer profiles"; date
for row in plait_trainer_ep2 plait_trainer_fsdp2; do
  timeout 150 $T --rows $row 2>&1 | tee $OUT/profile_$row.log | grep -E "^plait|PROFILE (kernel|dynamo)|failed"
done
echo "== CP x AC, EP all-gather on NCCL"; date
timeout 120 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/models/test_context_parallel.py \
  tests/moe/test_expert_parallel.py -k "full_ac or all_gather" \
  --tb=short -rfE > $OUT/tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
date
