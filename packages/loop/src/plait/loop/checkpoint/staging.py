"""The stage phase: copy the state's tensors to (pinned, shared) host memory so training can go on.

:class:`Staging` owns the stager (whose host buffers live as long as it) and the reservation of
those buffers, and of the writer process, ahead of the first save, off the critical path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from plait.loop.checkpoint.dcp_compat import ReusingStager
from torch.distributed.checkpoint.staging import StagingOptions

__all__ = ["Staging"]


class Staging:
    """The staging of a checkpointer's async saves.

    Args:
        pin_memory: stage into pinned (page-locked) host memory.
        shared_memory: stage into shared memory (the writer is another process).
    """

    def __init__(self, *, pin_memory: bool, shared_memory: bool) -> None:
        self.stager: ReusingStager | None = ReusingStager(
            StagingOptions(
                use_pinned_memory=pin_memory,
                use_shared_memory=shared_memory,
                use_async_staging=True,
                use_non_blocking_copy=pin_memory,
            )
        )
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None

    @property
    def reserved(self) -> bool:
        """Whether :meth:`reserve` was called."""
        return self._reserving is not None

    @property
    def reserving(self) -> bool:
        """Whether :meth:`reserve`'s background thread is still running."""
        return self._reserving is not None and self._reserving.is_alive()

    def reserve(self, tensors: list[torch.Tensor], start_process: Callable[[], None] | None) -> None:
        """In a background thread, run ``start_process`` (when given) and allocate the host buffers
        of ``tensors``; a failure is raised by the next :meth:`wait_reserved`."""
        stager = self.stager
        assert stager is not None, "reserve() after close()"

        def work() -> None:
            try:
                if start_process is not None:
                    start_process()
                stager.reserve(tensors)
            except BaseException as e:  # re-raised by the next save
                self._reserve_error = e

        self._reserving = threading.Thread(target=work, name="plait-checkpoint-reserve", daemon=True)
        self._reserving.start()

    def wait_reserved(self) -> None:
        """Wait for :meth:`reserve`'s thread; raise what it failed with."""
        if self._reserving is not None:
            self._reserving.join()
        if self._reserve_error is not None:
            err, self._reserve_error = self._reserve_error, None
            raise RuntimeError(f"preparing the checkpoint staging buffers failed: {err}") from err

    @staticmethod
    def wait_copied(response: Any) -> None:
        """Block until the async save ``response`` has copied the tensors out."""
        if response is not None and hasattr(response, "staging_completion"):
            response.staging_completion.result()

    def close(self) -> None:
        """Wait for a reservation and release the host buffers."""
        if self._reserving is not None:
            self._reserving.join()
        if self.stager is not None:
            self.stager.close()
            self.stager = None
