"""``python -m plait.loop.data tokenize --tokenizer DIR --output DIR INPUT...``: see :mod:`plait.loop.data.tokenize`."""

from __future__ import annotations

import argparse
import sys

from plait.loop.data.formats import AUTO, data_format, data_formats, formats_reading
from plait.loop.data.sources import DataSourceError
from plait.loop.data.tokenize import tokenize_corpus


def main(argv: list[str] | None = None, prog: str = "python -m plait.loop.data") -> int:
    """Run the command; returns the exit status (2 on bad input, with one message naming it)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    tok = sub.add_parser(
        "tokenize",
        help="tokenize a corpus into a memory-mappable token file and a document index",
        description="Tokenize INPUT files, directories or globs into OUTPUT/corpus.tokens (uint16 or uint32 "
        "by vocabulary size), OUTPUT/documents.npy (document start offsets) and OUTPUT/meta.json; "
        "train on it with data.format='tokens' and data.source=OUTPUT.",
    )
    tok.add_argument(
        "--tokenizer", required=True, help="a directory with tokenizer.json, or 'bytes' (byte-level tokens)"
    )
    tok.add_argument("--output", required=True, help="output directory")
    readable = [f for f in data_formats() if data_format(f).holds != "tokens"]  # tokens are tokenized already
    tok.add_argument("--format", default=AUTO, choices=[AUTO, *readable])
    tok.add_argument(
        "--text-field",
        default="text",
        help=f"the record field / table column of the text (formats {', '.join(formats_reading('text_field'))})",
    )
    tok.add_argument("--workers", type=int, default=None, help="encoding processes (default: the CPU count)")
    tok.add_argument("--batch-size", type=int, default=256, help="documents per task")
    tok.add_argument("--no-progress", action="store_true", help="no progress bar")
    tok.add_argument("inputs", nargs="+", metavar="INPUT")
    args = ap.parse_args(argv)
    try:
        meta = tokenize_corpus(
            args.inputs,
            args.tokenizer,
            args.output,
            fmt=args.format,
            text_field=args.text_field,
            workers=args.workers,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )
    except DataSourceError as e:
        print(f"{ap.prog} tokenize: error: {e}", file=sys.stderr)
        return 2
    print(
        f"{meta['num_tokens']} tokens ({meta['dtype']}) in {meta['num_documents']} documents -> {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
