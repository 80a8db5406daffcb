# Issue 22 on NCCL: every layout against the 1-GPU run from one seed checkpoint, the async checkpoint saved
# with FSDP x EP and resumed on half the GPUs with other layouts, LoRA fine-tuning (1 GPU, FSDP2) with the
# exported adapter loaded by peft, the pipeline schedules benchmark at pp=4, and the scaling figures.
#
#   bash benchmarks/multigpu/issue22_run.sh all4    # 4 GPUs (nvidia-h200-x4): parts a b c d e, one after another
#   bash benchmarks/multigpu/issue22_run.sh all8    # 8 GPUs (nvidia-h200-x8): parts f g (the 8-GPU layouts, scaling)
#   bash benchmarks/multigpu/issue22_run.sh a       # one part per device call (each part stays under 600 s)
#
# Parts (4 GPUs unless said; minutes are estimates from earlier runs of ~35-40 s per main-job launch):
#   a  layouts FSDP4, HSDP 2x2, DP2 x TP2, PP2 x EP2, EP4, CP2, CP2 x FSDP2, CP4             (~6 min)
#   b  layouts PP4 Interleaved 1F1B, PP4 ZB1P; async save FSDP4 x EP4, resume FSDP2 and PP2   (~5 min)
#   c  LoRA on 1 GPU and FSDP2 (adapter in peft); schedules benchmark at pp=4               (~6 min)
#   d  scaling: 1 GPU, FSDP4, EP4 x FSDP4, PP4 (per-GPU tok/s, MFU)                          (~5 min)
#   e  scaling: 1 GPU, FSDP2, EP2 x FSDP2, PP2                                               (~5 min)
#   f  8 GPUs: layouts PP2 x FSDP4 x EP2, FSDP8 x EP8, PP4 x DP2; save FSDP8 x EP8, resume FSDP4 and PP4
#   g  8 GPUs: scaling 1 GPU, FSDP8, EP8 x FSDP8, PP8
# Tables land in $OUT (layouts_<part>.md, scaling_<part>.md, schedules_pp4.log); the logs beside them.
# Part c needs peft (and its dependency accelerate) importable: carry their wheels in .whl/ if the image lacks them.
set -u
source benchmarks/multigpu/device_setup.sh >/dev/null
OUT=${OUT:-/tmp/issue22_out}
mkdir -p "$OUT"

layouts() {  # part, GPUs, --only list
  timeout 540 python3 benchmarks/multigpu/layouts.py --gpus "$2" --steps 12 --timeout 75 --only "$3" \
    --dir "/tmp/issue22_$1" --out "$OUT/layouts_$1.md" > "$OUT/layouts_$1.log" 2>&1
  echo "layouts $1 rc=$?"
  grep -E "^--- |Error" "$OUT/layouts_$1.log" | head -20
  cat "$OUT/layouts_$1.md"
}

scaling() {  # part, GPU count
  timeout 540 python3 benchmarks/multigpu/scaling.py --gpus "$2" --row-timeout 125 --out "$OUT/scaling_$1.md" \
    > "$OUT/scaling_$1.log" 2>&1
  echo "scaling $1 rc=$?"
  grep -E "failed|timed out|skipped" "$OUT/scaling_$1.log" | head -20
  cat "$OUT/scaling_$1.md"
}

part() {
  case "$1" in
    a) layouts a 4 "FSDP4,HSDP 2x2,DP2 x TP2,PP2 x EP2,EP4,CP2,CP2 x FSDP2,CP4" ;;
    b) layouts b 4 "PP4 Interleaved 1F1B,PP4 ZB1P,resume" ;;
    c)
      python3 -c "import peft; print('peft', peft.__version__)" || echo "peft missing: the adapter rows will fail"
      layouts c 2 lora
      bash benchmarks/multigpu/with_stacks.sh 300 "$OUT/schedules_pp4.log" torchrun --standalone --nproc-per-node 4 \
        benchmarks/pipelining/schedules.py --batch 32 --seq 2048 --microbatches 8
      echo "schedules pp=4 rc=$?"
      grep -E "^\||^- |TFLOP|hidden|Error|TIMEOUT" "$OUT/schedules_pp4.log"
      ;;
    d) scaling d 4 ;;
    e) scaling e 2 ;;
    f) layouts f 8 "PP2 x FSDP4 x EP2,FSDP8 x EP8,PP4 x DP2,resume" ;;
    g) scaling g 8 ;;
    *) echo "unknown part '$1' (a-g, all4, all8)"; return 2 ;;
  esac
}

case "${1:-}" in
  all4) for p in a b c d e; do part $p; done ;;
  all8) for p in f g; do part $p; done ;;
  *) part "${1:-}" ;;
esac
