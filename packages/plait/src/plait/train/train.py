"""``plait train``: train a decoder of any family; by default the embedded Qwen3-MoE on the Python
standard library's own source files (CPU, or CUDA when present).

    plait train                                             # the embedded default config
    plait train --config examples/configs/llama/gpu1.toml   # another family, one GPU
    plait train --data.source=my.jsonl                      # your one JSONL file (validation held out of it)
    plait train --init-from HF_DIR                          # start from a Hugging Face checkpoint
    torchrun --nproc-per-node 4 -m plait train --config examples/qwen3_moe/configs/gpu4.toml

Every config key (``--section.key=value`` overrides them, ``--key=value`` those outside the sections, e.g.
``--model_dtype=bfloat16``): ``plait config``, or the config reference of the docs. ``[model] model_type``
picks the family (Hugging Face's names); the other ``[model]`` keys are that family's ``config.json``
fields. With ``--init-from HF_DIR`` the checkpoint's ``config.json`` is the model (a ``[model]`` section
may then be left out; keys it sets must agree with the checkpoint's, except the training-only ones, which
override it) and its tokenizer the data's.

The run writes ``<run_dir>/metrics.jsonl``, async checkpoints under ``<run_dir>/checkpoints`` (a rerun
with the same run dir resumes; a finished run's rerun changes nothing), and at the end a Hugging Face
checkpoint in ``<run_dir>/hf``, ``summary.json`` and ``loss_curve.png``.

Bad flags, config files, paths or data stop it with one message and exit status 2 before anything is
built. Ctrl-C / SIGTERM finish the step, save a checkpoint, print the summary and exit with 130 / 143
(a signal repeated within two seconds, as uv, torchrun and terminals forward it, counts once), without the
Hugging Face export of the unfinished run unless ``--export-unfinished`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from plait.loop import ConfigError, RunDirLockedError, load_config, split_cli_overrides
from plait.loop.checkpoint import CheckpointWriteError
from plait.loop.data import Corpus, copy_tokenizer_files, recorded_tokenizer
from plait.train.config import JobConfig, StartupError
from plait.train.job import NO_MODEL, adopt_checkpoint_config, build_job, build_provider, check_startup

__all__ = ["DEFAULT_CONFIG", "main", "parse_args"]

DEFAULT_CONFIG = Path(str(resources.files("plait.train") / "configs" / "default.toml"))
"""The embedded default: a small Qwen3-MoE on the standard library's sources (CPU, or CUDA when present)."""


def parse_args(
    argv: list[str], prog: str = "plait train", default_config: Path = DEFAULT_CONFIG
) -> tuple[JobConfig, argparse.Namespace]:
    """Flags and dotted ``--section.key=value`` overrides -> the config and the flags.

    Raises:
        ConfigError: a missing or bad config file, or an override that does not validate.
        StartupError: an ``--init-from`` that is not a checkpoint or disagrees with ``[model]``.
        SystemExit: an unknown or misspelt flag (argparse's message, status 2).
    """
    ap = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ap.add_argument(
        "--config", type=Path, default=default_config, help="TOML/YAML/JSON config file (default: embedded)"
    )
    ap.add_argument("--steps", type=int, help="optimizer steps (overrides run.steps)")
    ap.add_argument("--run-dir", help="run directory (overrides run.run_dir)")
    ap.add_argument("--no-export", action="store_true", help="skip the final Hugging Face export")
    ap.add_argument(
        "--export-unfinished",
        action="store_true",
        help="write the Hugging Face export also when a signal stops the run before run.steps",
    )
    ap.add_argument(
        "--init-from",
        type=Path,
        help="start from this Hugging Face checkpoint (its config.json is the model; e.g. a seed checkpoint)",
    )
    ap.add_argument(
        "--write-seed-checkpoint",
        type=Path,
        metavar="DIR",
        help="write the freshly initialised model as a Hugging Face checkpoint to DIR and exit; every "
        "parallel layout that starts from it (--init-from DIR) starts from the same weights",
    )
    overrides, rest = split_cli_overrides(argv, JobConfig)
    args = ap.parse_args(rest)  # anything else, e.g. "--step 3" for "--steps 3", is an error
    if args.steps is not None:
        overrides.append(f"--run.steps={args.steps}")
    if args.run_dir is not None:
        overrides.append(f"--run.run_dir={args.run_dir}")
    config = load_config(args.config, overrides, cls=JobConfig)
    if args.init_from is not None:  # raises StartupError
        config = adopt_checkpoint_config(config, args.init_from)
    elif config.model is None:
        raise ConfigError(f"{args.config}: {NO_MODEL}")
    return config, args


def _write_dirs(config: JobConfig, args: argparse.Namespace) -> dict[str, str]:
    if args.write_seed_checkpoint is not None:
        return {"--write-seed-checkpoint": str(args.write_seed_checkpoint)}
    dirs = {"run.run_dir": config.run.run_dir}
    if config.checkpoint.enabled and config.checkpoint.dir:
        dirs["checkpoint.dir"] = config.checkpoint.dir
    return dirs


def complete_export(out: Path, corpus: Corpus) -> None:
    """What a Hugging Face export takes from the data: the tokenizer's files (AutoTokenizer then loads the
    export) and, when the model's config names none, the tokenizer's end-of-document token as
    ``eos_token_id`` (generation stops there)."""
    name = corpus.cfg.tokenizer or recorded_tokenizer(corpus.cfg)
    if name not in (None, "bytes"):
        copy_tokenizer_files(name, out)
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    if config.get("eos_token_id") is None:
        config["eos_token_id"] = corpus.tokenizer.eos_id
        tmp = config_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, config_file)


def fail(prog: str, message: object, status: int = 2) -> SystemExit:
    """Print ``prog: error: message`` on stderr; the ``SystemExit(status)`` to raise."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return SystemExit(status)


def main(argv: list[str] | None = None, prog: str = "plait train") -> dict[str, Any]:
    """Run the job; returns the last logged metrics (with ``--write-seed-checkpoint``: its directory).

    Raises:
        SystemExit: 2 on a bad flag, config or path (one message on stderr, nothing built), a run
            directory in use or a checkpoint this config may not resume; 1 on a checkpoint that could
            not be written (one message: which, where, why, what was kept); 128 + the signal number (130
            for Ctrl-C, 143 for SIGTERM) when a signal stopped the run.
    """
    try:
        config, args = parse_args(sys.argv[1:] if argv is None else argv, prog)
        seeding = args.write_seed_checkpoint is not None
        corpus = check_startup(config, write_dirs=_write_dirs(config, args), read_data=not seeding)
    except (ConfigError, StartupError) as e:
        raise fail(prog, e) from None
    provider = build_provider(config, args.init_from)
    if seeding:
        model = provider.build_stage(0, 1)
        provider.materialize(model, "cpu")
        return {"seed_checkpoint": str(provider.export_hf([model], args.write_seed_checkpoint))}
    job = build_job(config, config.data, provider, init_from=args.init_from, corpus=corpus)
    try:
        trainer = job.trainer()  # takes the run dir's lock, resumes
    except (ConfigError, RunDirLockedError) as e:  # a config or resume refused; a run dir in use
        raise fail(prog, e) from None
    if trainer.resume() is not None and trainer.step >= config.run.steps:
        # a rerun of a finished run: its summary, metrics and export stay as they are
        if trainer.topology.is_main:
            print(f"{trainer.run_dir}: already finished at step {trainer.step}; nothing to do")
        trainer.close()
        return {}
    try:
        summary = trainer.fit()
        if args.no_export:
            pass
        elif trainer.stop_signal is not None and not args.export_unfinished:
            if trainer.topology.is_main:
                print(
                    f"stopped by {signal.Signals(trainer.stop_signal).name} at step {trainer.step}: "
                    "no Hugging Face export of the unfinished run (--export-unfinished writes it)",
                    file=sys.stderr,
                )
        else:
            out = provider.export_hf(trainer.model_parts, trainer.run_dir / "hf")
            if trainer.topology.is_main:
                complete_export(out, job.corpus)
                print(f"Hugging Face checkpoint: {out}")
            trainer.run_summary.export = out
    except KeyboardInterrupt:  # Ctrl-C with checkpointing (and so the signal handler) off
        trainer.stop_signal = signal.SIGINT
        summary = {}
    except CheckpointWriteError as e:  # a full disk: the message says which checkpoint, path, what was kept
        raise fail(prog, e, 1) from None
    finally:
        trainer.close()
    if trainer.stop_signal is not None:
        sys.stdout.flush()
        raise SystemExit(128 + trainer.stop_signal)
    return summary
