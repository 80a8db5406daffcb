"""The ``plait`` command: ``plait train``, ``finetune``, ``tokenize``, ``export``, ``plan``, ``config`` and
``info``.

``torchrun --nproc-per-node N -m plait train ...`` runs the same command on N processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from plait.loop import ConfigError, load_config, split_cli_overrides

__all__ = ["COMMANDS", "config_main", "main"]


def _train(argv: list[str]) -> object:
    from plait.train.train import main

    return main(argv)


def _finetune(argv: list[str]) -> object:
    from plait.train.finetune import main

    return main(argv)


def _export(argv: list[str]) -> object:
    from plait.train.export import main

    return main(argv)


def _tokenize(argv: list[str]) -> object:
    from plait.loop.data.__main__ import main

    status = main(["tokenize", *argv], prog="plait")
    if status:
        raise SystemExit(status)
    return None


def _plan(argv: list[str]) -> object:
    from plait.train.planner import main

    main(argv)
    return None


def _info(argv: list[str]) -> object:
    from plait.loop.info import main

    if argv:
        raise SystemExit(f"plait info: takes no arguments, got {' '.join(argv)}")
    main()
    return None


def config_main(argv: list[str]) -> object:
    """``plait config [--config F] [--section.key=value ...] [--keys | --markdown | --schema]``: the
    resolved config (JSON), every key with its type, default and description, the reference page, or the
    JSON schema."""
    from plait.models import config_class_for, supported_model_types
    from plait.train.config import JobConfig
    from plait.train.reference import render_markdown, render_text
    from plait.train.train import DEFAULT_CONFIG

    ap = argparse.ArgumentParser(prog="plait config", description=config_main.__doc__, allow_abbrev=False)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config file (default: embedded)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--keys", action="store_true", help="every key: type, default, description")
    what.add_argument("--markdown", action="store_true", help="the config reference page (Markdown)")
    what.add_argument("--schema", action="store_true", help="the JSON schema of the config")
    overrides, rest = split_cli_overrides(argv, JobConfig)
    args = ap.parse_args(rest)
    if args.keys:
        print(render_text(JobConfig))
    elif args.markdown:
        print(render_markdown(JobConfig, {t: config_class_for(t) for t in supported_model_types()}), end="")
    elif args.schema:
        print(json.dumps(JobConfig.model_json_schema(), indent=1))
    else:
        try:
            config = load_config(args.config, overrides, cls=JobConfig)
        except ConfigError as e:
            raise SystemExit(f"plait config: error: {e}") from None
        print(json.dumps(config.model_dump(mode="json"), indent=1))
    return None


COMMANDS: dict[str, tuple[Callable[[list[str]], object], str]] = {
    "train": (_train, "train a model (default: the embedded Qwen3-MoE on the standard library)"),
    "finetune": (_finetune, "LoRA fine-tuning of a Hugging Face checkpoint; writes a PEFT adapter"),
    "tokenize": (_tokenize, "tokenize a corpus into a memory-mapped token file"),
    "export": (_export, "a Hugging Face checkpoint of any saved step of a run"),
    "plan": (_plan, "every layout of a job on N GPUs, memory and step time predicted (--explain L)"),
    "config": (config_main, "the resolved config, every key (--keys), the reference (--markdown)"),
    "info": (_info, "what is installed: packages, extras, devices, where to start"),
}


def usage() -> str:
    """The command's help: its subcommands."""
    width = max(map(len, COMMANDS))
    lines = ["usage: plait COMMAND [ARGS...]   (plait COMMAND --help for its own)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Dispatch to a subcommand; a bare ``plait`` is ``plait info``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["info"]
    if argv[0] in ("-h", "--help"):
        print(usage())
        return
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"plait: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    command[0](argv[1:])
