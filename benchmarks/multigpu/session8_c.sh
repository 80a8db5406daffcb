# Session 8, call C (nvidia-h200-x2, carry [".whl"]): FSDP2 with 1, 2 and 4 decoder layers per FSDP unit
# (--parallel.fsdp_layers_per_unit) against the 1-GPU compiled Trainer, same machine, same run.
source benchmarks/multigpu/device_setup.sh >/dev/null
T="python3 benchmarks/training/throughput.py --no-write --steps 16 --warmup 8 --row-timeout 120"
echo "== 1 GPU, FSDP2 (a unit per layer)"; date
timeout 260 $T --rows plait_trainer_compiled plait_trainer_fsdp2 2>&1 | tee $OUT/base.log | grep -E "^plait|failed"
for u in 2 4; do
  echo "== FSDP2, $u layers per unit"; date
  timeout 130 $T --rows plait_trainer_fsdp2 --trainer-args="--parallel.fsdp_layers_per_unit=$u" 2>&1 \
    | tee $OUT/units$u.log | grep -E "^plait|failed"
done
date
# Two follow-up calls on the same warm machine ran, with the same $T:
#   FSDP2 with 8 layers per unit; EP2 (plait_trainer_ep2) with 1 and 8 layers per unit;
#   then EP2 with 4 layers per unit and plait_trainer_compiled again (1-GPU repeat: 151.6k).
# (Since then the EP rows pass all of the model's layers by default: --parallel.fsdp_layers_per_unit=<layers>.)
