"""The main job as a script: the same as ``plait train`` (same flags; see ``plait train --help``).

    uv run examples/train.py --config examples/configs/llama/cpu.toml
    torchrun --nproc-per-node 2 examples/train.py --config examples/configs/llama/cpu.toml --mesh.data_shard=2

Without ``--config`` it trains the embedded default (a small Qwen3-MoE), as ``plait train`` does.
"""

from plait.train.train import main

if __name__ == "__main__":
    main(prog="train.py")
