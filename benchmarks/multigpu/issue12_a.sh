# Device run A (4 GPUs): dist-core NCCL tests, then the layout / schedule / checkpoint comparison.
source benchmarks/multigpu/device_setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m multigpu tests/dist_core 2>&1 | tail -15 | tee $OUT/dist_core_multigpu.txt
timeout 420 python3 benchmarks/multigpu/layouts.py --gpus 4 --steps 20 --timeout 120 --out $OUT/layouts.md > $OUT/layouts.log 2>&1
tail -30 $OUT/layouts.log
