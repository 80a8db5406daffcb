# Device run (2 x H200), session 5: why 2-GPU rows run at half the 1-GPU speed. The GPUs' links and
# NCCL bandwidth, then a profile of the FSDP2 Trainer row (after the host-side token count).
source benchmarks/multigpu/device_setup.sh
nvidia-smi nvlink -s 2>&1 | head -12
timeout 90 torchrun --standalone --nproc-per-node 2 benchmarks/multigpu/nccl_bandwidth.py > $OUT/nccl.log 2>&1; tail -22 $OUT/nccl.log
timeout 300 python3 benchmarks/training/throughput.py --no-write --steps 10 --warmup 8 --row-timeout 280 --profile \
  --rows plait_trainer_fsdp2 plait_trainer_ep2 > $OUT/tp_prof.log 2>&1
grep -E "PROFILE|^plait|failed|nccl|Name|---" $OUT/tp_prof.log | cut -c1-200 | head -60
