"""A tiny Trainer run as its own process (the run-directory and resume tests drive it).

Usage: python -m tests.loop._run_script RUN_DIR STEPS [--sleep S] [overrides...]. Prints
``training`` once the trainer is built (it then holds the run directory), sleeps ``S`` seconds after
each step, and exits with the loop's error, if any.
"""

from __future__ import annotations

import sys
import time

from plait.loop import (
    CausalLMTask,
    DatasetProvider,
    ModuleProvider,
    StepEnd,
    Trainer,
    load_config,
    pack_documents,
)

from tests.loop._lm import VOCAB, TinyLM, pattern_tokens


def main(argv: list[str]) -> None:
    run_dir, steps, rest = argv[0], int(argv[1]), argv[2:]
    sleep = 0.0
    if rest[:1] == ["--sleep"]:
        sleep, rest = float(rest[1]), rest[2:]
    config = load_config(
        overrides=[
            f"--run.run_dir={run_dir}",
            f"--run.steps={steps}",
            "--batching.global_batch_size=8",
            "--batching.microbatch_size=8",
            "--batching.seq_len=16",
            "--logging.progress_bar=false",
            "--checkpoint.enabled=true",
            "--checkpoint.async_mode=off",
            *rest,
        ]
    )
    data = DatasetProvider(pack_documents(pattern_tokens(), 16, eos_id=VOCAB - 1))
    trainer = Trainer(config, ModuleProvider(TinyLM), data, CausalLMTask())
    print("training", flush=True)
    trainer.subscribe(StepEnd, lambda e: time.sleep(sleep))
    try:
        trainer.fit()
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
