# Device run (2 x H200), session 4: this round's multigpu tests, with the whole pytest summary kept.
source benchmarks/multigpu/device_setup.sh
timeout 200 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/pipelining/test_schedule_sizes.py \
  tests/models/test_context_parallel.py tests/moe/test_expert_parallel.py --tb=line -rA > $OUT/mg.log 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/mg.log | cut -c1-200 | tail -25
