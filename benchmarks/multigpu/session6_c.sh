# Device run (2 x H200), session 6, call C: EP=2 x FSDP2 with 2 and 4 overlap chunks (parallel.expert_chunks);
# cp=2 trial at 593920 tokens (1.908x cp=1's longest) with allgather, cp=2 ring throughput; pytest -m gpu on
# one GPU; LoRA fine-tuning on 1 GPU and FSDP2 with the adapter loaded by peft (issue 22 part c, 2 GPUs).
source benchmarks/multigpu/device_setup.sh >/dev/null
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8"
for c in 2 4; do
  echo "== EP2 expert_chunks=$c"; date
  timeout 80 $T --row-timeout 75 --rows plait_trainer_ep2 --trainer-args="--parallel.expert_chunks=$c" 2>&1 \
    | tee $OUT/ep2_chunks$c.log | grep -E "^plait|failed"
done
echo "== CP2 at 593920 (allgather)"; date
timeout 110 torchrun --standalone --nproc-per-node 2 benchmarks/context/long_context.py --search cp2 \
  --search-from 593920 --granularity 4096 --max-seq 593920 --timeout 60 --markdown $OUT/cp_longest.md 2>&1 \
  | tee $OUT/cp_longest.log | grep -E "^cp=|^\||Longest|Error"
echo "== pytest -m gpu"; date
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests --tb=short -rfE > $OUT/gpu_tests.log 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | cut -c1-220 | tail -15
echo "== LoRA 1 GPU and FSDP2"; date
timeout 140 python3 benchmarks/multigpu/layouts.py --gpus 2 --steps 12 --timeout 60 --only lora \
  --dir /tmp/s6_lora --out $OUT/layouts_lora.md > $OUT/layouts_lora.log 2>&1
echo "rc=$?"; grep -E "^--- |Error" $OUT/layouts_lora.log | head; cat $OUT/layouts_lora.md
date
