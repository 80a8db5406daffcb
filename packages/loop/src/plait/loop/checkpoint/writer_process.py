"""The writer phase's background process: DCP's checkpoint writer process, as an object.

DCP keeps one writer process per Python process (a global of DCP's), shared by every process-mode
save. :class:`WriterProcess` owns what plait adds around it: the store it joins, its console
logging, when it starts (ahead of the first save, off the critical path) and when it stops (when
the last process-mode :class:`~plait.loop.checkpoint.Checkpointer` using it closes, not at
interpreter exit). Because DCP's process is process-wide, so is :data:`WRITER_PROCESS`, the
instance a Checkpointer uses unless it is passed another.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from plait.loop.checkpoint import dcp_compat

__all__ = ["WRITER_PROCESS", "WriterProcess"]


def _writer_process_main(pg_init_info: Any, parent_conn: Any) -> None:
    """DCP's writer process entry (run in that process) with warnings and errors only on its stderr.

    DCP's own entry sets the writer's root logger to INFO with a stream handler, so every
    checkpoint printed ``Waiting for checkpoint save request...`` and the like on the console.
    """
    # A Ctrl-C reaches every process of the terminal's group: the training process decides what it means
    # (finish the step, save, exit 130), so the writer must not die of it mid-save. It was spawned with
    # SIGINT blocked (``dcp_compat.prepare_writer_process_start``): one that came while it imported is
    # pending, and discarded when it is unblocked under SIG_IGN.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def init_logger(rank: int) -> None:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(f"[checkpoint writer of rank {rank}] %(levelname)s %(message)s")
        )
        root = logging.getLogger()
        root.setLevel(logging.WARNING)
        root.addHandler(handler)

    dcp_compat.run_writer_process_entry(pg_init_info, parent_conn, init_logger=init_logger)


class WriterProcess:
    """DCP's background writer process of this Python process, shared by process-mode checkpointers.

    Each user calls :meth:`acquire` once and :meth:`release` once (in its ``close()``); the last
    release stops the process. The process joins the job's own store (torchrun's
    ``MASTER_ADDR``/``MASTER_PORT``; a one-process job without them gets a store on 127.0.0.1 that
    lives as long as this object) under a prefix, instead of opening a store of its own, which would
    listen on every network interface.
    """

    def __init__(self) -> None:
        self._loopback_store: Any = None
        self._users = 0

    @property
    def users(self) -> int:
        """How many acquirers have not released it yet."""
        return self._users

    def acquire(self, world_size: int) -> None:
        """Register a user in a job of ``world_size`` processes: join the job's store and start the
        process with quiet logging when it starts.

        Raises:
            ValueError: several processes without ``MASTER_ADDR``/``MASTER_PORT`` (use torchrun, or
                init the process group with ``init_method="env://"``, or another async mode).
        """
        self._join_job_store(world_size)
        dcp_compat.route_writer_process_entry(_writer_process_main)
        self._users += 1

    def release(self) -> None:
        """Unregister a user; the last one stops the process (a later save starts a new one)."""
        if self._users <= 0:
            raise RuntimeError("WriterProcess.release() without a matching acquire()")
        self._users -= 1
        if self._users == 0:
            self.stop()

    def prepare_start(self, process_group: dist.ProcessGroup | None) -> Callable[[], None] | None:
        """Gather the process's group information now (a collective: call on every rank) and return
        a function that starts the process (safe to run in a background thread); None when it runs."""
        return dcp_compat.prepare_writer_process_start(process_group)

    @property
    def process(self) -> Any:
        """DCP's running writer process, or None."""
        return dcp_compat.writer_process()

    def stop(self) -> None:
        """Stop the process now (DCP would stop it at interpreter exit, when the process group and
        store it was started with may already be gone, so a finished job could exit with an abort)."""
        dcp_compat.stop_writer_process()

    def _join_job_store(self, world_size: int) -> None:
        if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
            if world_size > 1:
                raise ValueError(
                    "checkpoint async_mode='process' needs MASTER_ADDR and MASTER_PORT in the environment "
                    "(torchrun sets them): the writer processes join the job's store; use async_mode='thread' otherwise"
                )
            if self._loopback_store is None:
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                sock.listen()
                port = sock.getsockname()[1]
                self._loopback_store = dist.TCPStore(
                    "127.0.0.1", port, None, True, master_listen_fd=sock.detach(), wait_for_workers=False
                )
            dcp_compat.use_job_store("127.0.0.1", self._loopback_store.port)
        else:
            dcp_compat.use_job_store()


WRITER_PROCESS = WriterProcess()
"""Process-wide: DCP runs one writer process per Python process, so the checkpointers of a process
share this object unless they are given another."""
