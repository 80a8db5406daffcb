# Device run (2 x H200), session 7, call C: the all-gather EP dispatch (tokens all-gathered, outputs
# reduce-scattered) against the padded all-to-all: the MoE layer alone, the no-sync NCCL tests, and the
# EP2 Trainer rows of both models (throughput's 1.14B and the gpu1.toml model of scaling.md).
source benchmarks/multigpu/device_setup.sh >/dev/null
echo "== MoE layer"; date
timeout 90 torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_overlap.py --markdown $OUT/moe_ep_overlap.md \
  2>&1 | tee $OUT/ep_overlap.log | grep -E "^\||Error"
echo "== tests"; date
timeout 100 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/moe/test_expert_parallel.py -k no_sync \
  --tb=short -rfE > $OUT/tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/tests.log | cut -c1-250 | tail -8
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 110"
AG="--trainer-args=--parallel.expert_dispatch=all_gather"
echo "== Trainer rows, 1.14B"; date
timeout 200 $T --rows plait_trainer_compiled plait_trainer_ep2 2>&1 | tee $OUT/rows.log | grep -E "^plait|failed"
timeout 100 $T --rows plait_trainer_ep2 $AG 2>&1 | tee $OUT/rows_ag.log | grep -E "^plait|failed"
echo "== Trainer rows, gpu1 model"; date
timeout 100 $T --model gpu1 --rows plait_trainer_ep2 $AG 2>&1 | tee $OUT/rows_gpu1_ag.log | grep -E "^plait|failed"
date
