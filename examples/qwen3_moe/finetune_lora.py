"""LoRA fine-tuning: the same as ``plait finetune`` (same flags; see ``plait finetune --help``).

uv run examples/qwen3_moe/finetune_lora.py --base runs/qwen3_moe/hf --steps 30 --run-dir runs/lora
"""

from plait.train.finetune import main

if __name__ == "__main__":
    main(prog="finetune_lora.py")
