# Session 8, call A (nvidia-h200-x2, carry [".whl"]): per-chunk cuDNN CP attention on NCCL, its 32k
# throughput against FlexAttention (eager and compiled layers), whether 610304 tokens still train with
# cp=2, and where the FSDP2 Trainer step's host time goes.
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== CP attention on NCCL"; date
timeout 150 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/models/test_context_parallel.py \
  -k "attention_on_two_gpus" --tb=short -rfE > $OUT/tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
L="torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py"
echo "== 32k eager"; date
timeout 200 $L --search none --flex-row --markdown $OUT/lc_eager.md 2>&1 | tee $OUT/lc_eager.log | grep -E "^\||Error|error" | tail -8
echo "== 32k compiled"; date
timeout 240 $L --search none --flex-row --compile --markdown $OUT/lc_compiled.md 2>&1 | tee $OUT/lc_compiled.log | grep -E "^\||Error|error" | tail -8
echo "== FSDP2 Trainer profile"; date
timeout 110 python3 benchmarks/training/throughput.py --no-write --steps 8 --warmup 8 --row-timeout 100 --profile \
  --rows plait_trainer_fsdp2 > $OUT/profile_fsdp2.log 2>&1; grep -E "^plait|PROFILE (kernel|dynamo)" $OUT/profile_fsdp2.log
echo "== cp=2 at 610304 tokens (chunk kernels)"; date
timeout 150 $L --search cp2 --search-from 610304 --max-seq 610304 --granularity 610304 --search-only 2>&1 \
  | tee $OUT/lc_longest.log | grep -E "cp=2 seq|longest|Error" | tail -4
date
