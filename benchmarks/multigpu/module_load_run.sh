# Device run (2 GPUs): does a first kernel load wait for an in-flight NCCL receive (lazy vs eager module
# loading)? The main job PP2 1F1B with eager loading; the async-save benchmark with a real background process.
source benchmarks/multigpu/device_setup.sh
for mode in LAZY EAGER; do
  CUDA_MODULE_LOADING=$mode timeout 90 torchrun --standalone --nproc-per-node 2 \
    benchmarks/multigpu/module_load_probe.py 2>&1 | grep CUDA_MODULE_LOADING
done
BASE="--logging.progress_bar=false --logging.interval=1 --no-export --batching.global_batch_size=16
  --batching.microbatch_size=2 --batching.seq_len=256 --data.max_files=200 --model.num_hidden_layers=8 --run.device=cuda"
python3 examples/qwen3_moe/pretrain.py $BASE --write-seed-checkpoint=/tmp/seed > $OUT/seed.log 2>&1 || tail $OUT/seed.log
CUDA_MODULE_LOADING=EAGER bash benchmarks/multigpu/with_stacks.sh 100 $OUT/pp2_eager.log torchrun --standalone \
  --nproc-per-node 2 examples/qwen3_moe/pretrain.py $BASE --steps=10 --init-from=/tmp/seed \
  --checkpoint.enabled=false --mesh.pipeline=2 --pipeline.kind=1f1b --run-dir=/tmp/pp2e
echo "pp2 eager rc=$?"; grep -E "TIMEOUT|Error|File \"$PWD" $OUT/pp2_eager.log | head -20
python3 -c "import json; print([round(json.loads(l)['loss'], 6) for l in open('/tmp/pp2e/metrics.jsonl')])"
timeout 230 python3 benchmarks/checkpoint/async_save.py --params-b 1.0 --saves 3 --modes off,process \
  > $OUT/checkpoint.log 2>&1; echo "checkpoint rc=$?"; grep -v Warn $OUT/checkpoint.log | tail -6
