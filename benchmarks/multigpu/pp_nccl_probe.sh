# Device run (2 GPUs): where does pipeline parallelism on NCCL stop? Stacks are dumped on a hang.
source benchmarks/multigpu/device_setup.sh
W=benchmarks/multigpu/with_stacks.sh
show() { grep -E "TIMEOUT|Error|error|File \"$PWD|^\||done|rc=" "$1" | grep -v Warning | tail -${2:-40}; }
# 1. the executor alone (eager NCCL init, world group), plait and torch 1F1B
bash $W 100 $OUT/sched_probe.log torchrun --standalone --nproc-per-node 2 benchmarks/pipelining/schedules.py \
  --schedules 1f1b --steps 3 --warmup 1; echo "schedules rc=$?"; show $OUT/sched_probe.log
# 2. the main job, PP2 1F1B (device-mesh sub-groups, lazy NCCL init)
BASE="--logging.progress_bar=false --logging.interval=1 --no-export --batching.global_batch_size=16
  --batching.microbatch_size=2 --batching.seq_len=256 --data.max_files=200 --model.num_hidden_layers=8 --run.device=cuda"
python3 examples/qwen3_moe/pretrain.py $BASE --write-seed-checkpoint=/tmp/seed > $OUT/seed.log 2>&1 || tail $OUT/seed.log
PP="--steps=5 --init-from=/tmp/seed --checkpoint.enabled=false --mesh.pipeline=2 --pipeline.kind=1f1b"
bash $W 80 $OUT/pp2.log torchrun --standalone --nproc-per-node 2 examples/qwen3_moe/pretrain.py $BASE $PP \
  --run-dir=/tmp/pp2; rc=$?; echo "pp2 rc=$rc"; show $OUT/pp2.log 60
if [ $rc != 0 ]; then
  TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=WARN bash $W 70 $OUT/pp2_detail.log torchrun --standalone \
    --nproc-per-node 2 examples/qwen3_moe/pretrain.py $BASE $PP --run-dir=/tmp/pp2d; echo "pp2 detail rc=$?"
  show $OUT/pp2_detail.log 60
fi
cat /tmp/pp2/metrics.jsonl 2>/dev/null | head -5
# 3. issue 4: model-state load throughput into CUDA (one GPU)
df -h /tmp /dev/shm | tail -2
timeout 200 python3 benchmarks/model_state/load_throughput.py --size-gb 8 --device cuda --repeats 2 \
  > $OUT/model_state.log 2>&1; echo "model_state rc=$?"; tail -15 $OUT/model_state.log
