# What session 6 built after its device time was spent (2 x H200; ~8 min). Run on nvidia-h200-x2:
#   bash benchmarks/multigpu/pending_gpu_checks.sh      (with carry [".whl"]; logs in $OUT)
# 1. EP=2 x FSDP2 Trainer rows: exact-split vs padded dispatch (compiled layers), next to 1 GPU and FSDP2.
# 2. The MoE layer alone: ep_overlap.py's rows, padded included (and rank 0's traces with --profile).
# 3. The new gpu / multigpu tests: padded dispatch on NCCL under CUDA's sync debug mode, the adapter init
#    and materialize RNG tests, the compile tests.
# 4. LoRA 1 GPU vs FSDP2 again (session 6: 1.27e-2 apart before the RNG fixes).
source benchmarks/multigpu/device_setup.sh >/dev/null
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 110"
echo "== Trainer rows"; date
timeout 250 $T --rows plait_trainer_compiled plait_trainer_fsdp2 plait_trainer_ep2 2>&1 | tee $OUT/rows.log | grep -E "^plait|failed"
timeout 120 $T --rows plait_trainer_ep2 --trainer-args="--parallel.expert_dispatch=all_to_all_padded" 2>&1 \
  | tee $OUT/ep2_padded.log | grep -E "^plait|failed"
echo "== MoE layer"; date
timeout 90 torchrun --standalone --nproc-per-node 2 benchmarks/moe/ep_overlap.py --markdown $OUT/moe_ep_overlap.md \
  2>&1 | tee $OUT/ep_overlap.log | grep -E "^\||Error"
echo "== tests"; date
timeout 120 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests/moe/test_expert_parallel.py \
  tests/peft/test_lora.py tests/models/test_gpu.py tests/models/test_compile.py --tb=short -rfE > $OUT/tests.log 2>&1
echo "rc=$?"; grep -E "^E |^(FAILED|ERROR)|passed|failed" $OUT/tests.log | cut -c1-250 | tail -10
echo "== LoRA"; date
timeout 120 python3 benchmarks/multigpu/layouts.py --gpus 2 --steps 12 --timeout 60 --only lora --dir /tmp/lora \
  --out $OUT/layouts_lora.md > $OUT/layouts_lora.log 2>&1; echo "rc=$?"; cat $OUT/layouts_lora.md
date
