# Device run (2 GPUs), not yet run: the main job PP2 1F1B with the executor's DEBUG trace in per-rank logs.
# The last "posts" lines without a following "group done" on each rank show which groups are outstanding.
source benchmarks/multigpu/device_setup.sh > /dev/null
BASE="--logging.progress_bar=false --logging.level=DEBUG --no-export --batching.global_batch_size=16
  --batching.microbatch_size=2 --batching.seq_len=256 --data.max_files=200 --model.num_hidden_layers=8 --run.device=cuda"
bash benchmarks/multigpu/with_stacks.sh 75 $OUT/run.log torchrun --standalone --nproc-per-node 2 --redirects 3 \
  --log-dir $OUT/logs examples/qwen3_moe/pretrain.py $BASE --steps=3 --checkpoint.enabled=false \
  --mesh.pipeline=2 --pipeline.kind=1f1b --run-dir=/tmp/pp2t
echo "rc=$?"
for f in $(find $OUT/logs -name stderr.log | sort); do echo "== $f"; grep "pp-rank" "$f" | tail -6; done
