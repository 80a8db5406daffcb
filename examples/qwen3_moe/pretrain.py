"""Pretrain a small Qwen3-MoE: the same as ``plait train`` (same flags; see ``plait train --help``).

    uv run examples/qwen3_moe/pretrain.py                         # the embedded CPU default (CUDA when present)
    uv run examples/qwen3_moe/pretrain.py --steps 50 --run-dir runs/x --optimizer.lr=1e-3
    uv run examples/qwen3_moe/pretrain.py --config examples/qwen3_moe/configs/gpu1.toml
    torchrun --nproc-per-node 2 examples/qwen3_moe/pretrain.py --mesh.data_shard=2 --mesh.expert=2

This folder's configs are Qwen3-MoE's; a ``[model]`` section without ``model_type`` is ``qwen3_moe``.
"""

from plait.train.train import main

if __name__ == "__main__":
    main(prog="pretrain.py")
