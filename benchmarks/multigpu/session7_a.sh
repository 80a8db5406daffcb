# Device run (2 x H200), session 7, call A: the padded EP dispatch's no-sync test (bf16, forward + backward);
# the CP multigpu tests with the all-gather attention re-gathering K/V in the backward; the longest cp=2
# sequence above 598016 (session 6's bound) and the 32k throughput with the re-gather.
# As run at commit 5a9995a; the padded dispatch it tests was removed after call C (all_gather replaced it).
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== tests"; date
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests/models/test_context_parallel.py \
  "tests/moe/test_expert_parallel.py::test_ep2_nccl_padded_matches_reference_without_host_sync" --tb=short -rfE \
  > $OUT/tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/tests.log | cut -c1-250 | tail -12
L="torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py"
echo "== cp=2 search"; date
timeout 240 $L --search-only --granularity 4096 --search cp2 --fits-at 598016 --search-from 602112 --max-seq 618496 \
  --timeout 60 2>&1 | tee $OUT/cp2_search.log | grep -E "^cp=|Longest|Error"
echo "== CP throughput"; date
timeout 120 $L --search none --markdown $OUT/cp_allgather.md 2>&1 | tee $OUT/cp_tp.log | grep -E "^\||Error"
date
