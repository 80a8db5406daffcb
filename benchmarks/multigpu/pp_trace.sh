# Device run (2 GPUs): the main job with PP2 for each schedule given (default 1f1b zbv), with the executor's
# DEBUG trace in per-rank logs ($OUT/logs_<kind>/.../stderr.log). On a hang, with_stacks.sh dumps every
# process's Python stacks into the same logs. The last "posts" lines without a following "group done" on
# each rank show which communication groups are outstanding.
source benchmarks/multigpu/device_setup.sh > /dev/null
BASE="--logging.progress_bar=false --logging.level=DEBUG --no-export --batching.global_batch_size=16
  --batching.microbatch_size=2 --batching.seq_len=256 --data.max_files=200 --model.num_hidden_layers=8 --run.device=cuda"
for kind in ${@:-1f1b zbv}; do
  bash benchmarks/multigpu/with_stacks.sh 90 $OUT/run_$kind.log torchrun --standalone --nproc-per-node 2 \
    --redirects 3 --log-dir $OUT/logs_$kind examples/qwen3_moe/pretrain.py $BASE --steps=3 \
    --checkpoint.enabled=false --mesh.pipeline=2 --pipeline.kind=$kind --run-dir=/tmp/pp2_$kind
  echo "== $kind rc=$?"
  for f in $(find $OUT/logs_$kind -name stderr.log | sort); do
    echo "-- $f"; grep -E "pp-rank|step" "$f" | tail -5
    cp "$f" "$OUT/${kind}_rank$(basename $(dirname $f)).log"  # the device tool does not return deep paths
  done
  rm -rf $OUT/logs_$kind
done
