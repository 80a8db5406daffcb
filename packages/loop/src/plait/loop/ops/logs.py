"""Log records prefixed by this rank's mesh coordinates, e.g. ``[rank 3 pp1 dp1]``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

__all__ = ["mesh_prefix", "setup_logging"]


def mesh_prefix(rank: int, coords: Mapping[str, int], sizes: Mapping[str, int]) -> str:
    """``[rank R dim<i> ...]`` with only the dimensions of size > 1."""
    dims = " ".join(f"{d}{coords[d]}" for d in coords if sizes.get(d, 1) > 1)
    return f"[rank {rank}{' ' + dims if dims else ''}]"


class _PrefixFilter(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        record.mesh = self.prefix
        return True


class _PlaitHandler(logging.StreamHandler):
    """The stream handler :func:`setup_logging` installs (and replaces on a second call). Its lines go
    through ``tqdm.write``: an open progress bar is cleared, the line printed on a line of its own, and the
    bar drawn again below it (a plain write would glue the line to the bar's)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(prefix: str, level: str = "INFO", logger_name: str = "plait") -> logging.Logger:
    """Give the ``plait`` logger one stream handler whose lines start with ``prefix``."""
    logger = logging.getLogger(logger_name)
    logger.setLevel(level)
    for h in list(logger.handlers):
        if isinstance(h, _PlaitHandler):
            logger.removeHandler(h)
    handler = _PlaitHandler()
    handler.addFilter(_PrefixFilter(prefix))
    handler.setFormatter(logging.Formatter("%(asctime)s %(mesh)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
