"""Errors raised by the distributed test harness."""

from __future__ import annotations


class DistributedTestError(AssertionError):
    """A distributed call failed: a rank raised, crashed, or the call timed out.

    Subclasses ``AssertionError`` so pytest reports it as a test failure. The message names the
    failing rank(s) and holds their tracebacks (or, on a timeout, the stacks of the stuck ranks).

    Attributes:
        failed_ranks: the ranks that raised, crashed or did not finish.
    """

    def __init__(self, message: str, failed_ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.failed_ranks: list[int] = list(failed_ranks or [])
