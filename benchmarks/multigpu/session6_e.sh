# Device run (2 x H200), session 6, call E: the longest sequence at 4096 granularity between the known bounds
# (cp=1: 312320 fits, 327680 does not; cp=2 allgather: 593920 fits, 606208 does not).
source benchmarks/multigpu/device_setup.sh >/dev/null
L="torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search-only --granularity 4096"
date; timeout 130 $L --search cp1 --fits-at 312320 --search-from 316416 --max-seq 323584 2>&1 | tee $OUT/cp1_search.log \
  | grep -E "^cp=|Longest|Error"
date; timeout 120 $L --search cp2 --fits-at 593920 --search-from 598016 --max-seq 602112 --timeout 60 2>&1 \
  | tee $OUT/cp2_search.log | grep -E "^cp=|Longest|Error"
date
