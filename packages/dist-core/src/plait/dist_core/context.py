"""The distributed context of one rank: process groups, the five mesh domains, rank facts."""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from plait.dist_core.domains import DOMAIN_DIMS, check_domain, domain_coordinates, domain_layout
from plait.dist_core.mesh_params import DeviceMeshParameters
from torch.distributed.device_mesh import DeviceMesh

_LOGGER_NAME = "plait"


class _MeshLoggerAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes every message with the rank's mesh coordinates, e.g. ``[pp0 dp1 cp0 tp0]``."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.extra['prefix']} {msg}" if self.extra else msg, kwargs  # type: ignore[index]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def release_cuda_graphs() -> None:
    """Free the CUDA graphs of ``torch.compile``'s graph trees (``mode="reduce-overhead"``) in this process.

    NCCL keeps a communicator alive while any CUDA graph that captured one of its collectives exists:
    destroying the process groups before those graphs waits forever (pytorch/pytorch#115388). Graphs of
    layers with collectives inside (the all-gather expert dispatch) are such graphs, so the groups'
    teardown calls this first. A graph needed again later is recorded anew. Nothing happens where the
    graph trees were never imported or CUDA never started.
    """
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    trees.reset_cudagraph_trees()
    gc.collect()  # a graph held in a reference cycle (cached outputs, gradients) goes now, not later


def _resolve(host: str | None) -> str | None:
    if not host:
        return None
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"MASTER_ADDR={host!r} does not resolve to an address: {e}") from None


class DistributedContext:
    """Process groups and device meshes of one rank, built from :class:`DeviceMeshParameters`.

    Build it with :meth:`from_env`. It exposes five mesh domains over the same ranks
    (see :mod:`plait.dist_core.domains`) through :meth:`mesh_for`, rank facts, barriers,
    main-process-first blocks, per-phase timeouts and a logger prefixed with mesh coordinates.
    """

    def __init__(
        self,
        params: DeviceMeshParameters,
        device: torch.device,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        node_rank: int,
        owns_default_group: bool,
        num_nodes: int = 1,
        master_addr: str | None = None,
    ) -> None:
        """Use :meth:`from_env`; this constructor only stores what it is given."""
        self._params = params
        self._device = device
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._local_world_size = local_world_size
        self._node_rank = node_rank
        self._num_nodes = num_nodes
        self._master_addr = master_addr
        self._owns_default_group = owns_default_group
        self._host_group: dist.ProcessGroup | None = None
        self._owns_host_group = False
        self._meshes: dict[str, DeviceMesh] = {}
        self._shut_down = False
        coords = domain_coordinates(params, "batch", rank)
        prefix = "[" + " ".join(f"{k}{v}" for k, v in coords.items()) + "]"
        self.logger: logging.LoggerAdapter = _MeshLoggerAdapter(  # type: ignore[type-arg]
            logging.getLogger(_LOGGER_NAME), {"prefix": prefix}
        )

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_env(
        cls,
        params: DeviceMeshParameters,
        device: str | torch.device | None = None,
        *,
        timeout: float | None = None,
        log_level: int | str | None = None,
    ) -> DistributedContext:
        """Build the context of this rank from torchrun's environment.

        - Every degree 1 and ``WORLD_SIZE`` unset or 1: single process, no process group (a
          world-size-1 group is created only if :meth:`mesh_for` is called).
        - A default process group already initialised (e.g. inside
          :func:`plait.dist_core.testing.run_distributed`): it is reused, not destroyed by
          :meth:`shutdown`.
        - Otherwise the default group is initialised from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
          ``MASTER_PORT`` with NCCL for CUDA devices and gloo for CPU.

        With a CUDA device, a gloo group over all ranks is added for host-side collectives
        (:attr:`host_group`); on CPU the default group is the host group. All five mesh domains
        are then built (a collective call: every rank must call ``from_env`` with equal params).

        Args:
            params: parallelism degrees; their product must equal the world size.
            device: ``"cpu"``, ``"cuda"`` (the rank's ``LOCAL_RANK`` device) or a torch.device;
                default CUDA when available, else CPU.
            timeout: collective timeout in seconds for the groups created here (torch's default
                when None).
            log_level: level of the ``plait`` logger (e.g. ``"INFO"``, ``logging.DEBUG``); None leaves it.

        Raises:
            ValueError: the degrees do not match the world size, the device is unsupported, or
                ``MASTER_ADDR`` does not resolve.
        """
        if log_level is not None:
            logging.getLogger(_LOGGER_NAME).setLevel(
                log_level.upper() if isinstance(log_level, str) else log_level
            )
        local_rank = _env_int("LOCAL_RANK", 0)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        pg_timeout = None if timeout is None else timedelta(seconds=timeout)

        owns = False
        if dist.is_available() and dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
        else:
            world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
        params.validate_world_size(world_size)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if world_size > 1 and not dist.is_initialized():
            backend = "nccl" if dev.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size}
            if pg_timeout is not None:
                kwargs["timeout"] = pg_timeout
            if dev.type == "cuda":  # binds the group to the device: barriers need not guess it (and warn)
                kwargs["device_id"] = dev
            store = _attempt_store(world_size, pg_timeout)
            if store is not None:
                kwargs["store"] = store
            dist.init_process_group(**kwargs)
            owns = True

        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)  # without torchrun: one node
        node_rank = _env_int("GROUP_RANK", rank // max(local_world_size, 1))
        num_nodes = _env_int("GROUP_WORLD_SIZE", -(-world_size // max(local_world_size, 1)))
        ctx = cls(
            params,
            dev,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            owns_default_group=owns,
            num_nodes=num_nodes,
            master_addr=_resolve(os.environ.get("MASTER_ADDR")),
        )
        if dist.is_initialized():
            ctx._init_groups(pg_timeout)
        return ctx

    def _init_groups(self, pg_timeout: timedelta | None) -> None:
        backend = str(dist.get_backend()).lower()
        if backend == "fake" or ("gloo" in backend and self._device.type == "cpu"):
            self._host_group = dist.group.WORLD  # type: ignore[assignment]
        else:
            # Host-side collectives (objects, barriers) should not go through NCCL.
            kwargs: dict[str, Any] = {"backend": "gloo"}
            if pg_timeout is not None:
                kwargs["timeout"] = pg_timeout
            self._host_group = dist.new_group(**kwargs)  # type: ignore[assignment]
            self._owns_host_group = True
        # Same call order on every rank: DeviceMesh creation is collective.
        for domain in DOMAIN_DIMS:
            self._meshes[domain] = self._build_mesh(domain)

    # -- meshes ----------------------------------------------------------------------------------
    def mesh_for(self, domain: str) -> DeviceMesh:
        """The device mesh of ``domain``: ``"regular"``, ``"dense"``, ``"expert"``, ``"batch"`` or ``"flat"``.

        In single-process mode the first call initialises a world-size-1 process group (an
        in-memory store, no network) because torch's DeviceMesh needs one.

        Raises:
            ValueError: unknown domain (the message lists the valid ones).
        """
        check_domain(domain)
        if self._shut_down:
            raise RuntimeError("DistributedContext was shut down")
        if not self._meshes:
            if not dist.is_initialized():
                cuda = self._device.type == "cuda"
                dist.init_process_group(
                    "nccl" if cuda else "gloo",
                    store=dist.HashStore(),
                    rank=0,
                    world_size=1,
                    device_id=self._device if cuda else None,  # bound: barriers need not guess (and warn)
                )
                self._owns_default_group = True
            self._init_groups(None)
        if domain not in self._meshes:  # registered after this context was built
            self._meshes[domain] = self._build_mesh(domain)
        return self._meshes[domain]

    def _build_mesh(self, domain: str) -> DeviceMesh:
        return DeviceMesh(
            self._device.type, domain_layout(self._params, domain), mesh_dim_names=DOMAIN_DIMS[domain]
        )

    def coordinates(self, domain: str) -> dict[str, int]:
        """This rank's coordinates in ``domain``, e.g. ``{"pp": 0, "dp": 1, "cp": 0, "tp": 1}``."""
        return domain_coordinates(self._params, domain, self._rank)

    def group_ranks(self, domain: str, dim: str) -> list[int]:
        """Global ranks of this rank's group along ``dim`` of ``domain`` (no process group needed)."""
        check_domain(domain)
        names = DOMAIN_DIMS[domain]
        if dim not in names:
            raise ValueError(
                f"mesh domain {domain!r} has no dimension {dim!r}; its dimensions: {', '.join(names)}"
            )
        layout = domain_layout(self._params, domain)
        coords = self.coordinates(domain)
        index = tuple(slice(None) if name == dim else coords[name] for name in names)
        return layout[index].tolist()  # type: ignore[no-any-return]

    # -- facts -----------------------------------------------------------------------------------
    @property
    def params(self) -> DeviceMeshParameters:
        """The parallelism degrees."""
        return self._params

    @property
    def device(self) -> torch.device:
        """This rank's device (``cuda:LOCAL_RANK`` or ``cpu``)."""
        return self._device

    @property
    def rank(self) -> int:
        """Global rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank within this node (torchrun's ``LOCAL_RANK``)."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``)."""
        return self._local_world_size

    @property
    def node_rank(self) -> int:
        """Index of this node (torchrun's ``GROUP_RANK``; else ``rank // local_world_size``)."""
        return self._node_rank

    @property
    def num_nodes(self) -> int:
        """Number of nodes (torchrun's ``GROUP_WORLD_SIZE``; else ``world_size / local_world_size``)."""
        return self._num_nodes

    @property
    def master_addr(self) -> str | None:
        """The rendezvous host's IP address (``MASTER_ADDR`` resolved at construction; None when unset)."""
        return self._master_addr

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self._rank == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on local rank 0 of each node."""
        return self._local_rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group is in use (always false in single-process mode before ``mesh_for``)."""
        return dist.is_initialized() and not self._shut_down

    @property
    def host_group(self) -> dist.ProcessGroup | None:
        """A gloo group over all ranks for CPU-side collectives (None in single-process mode)."""
        return self._host_group

    # -- synchronisation -------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait for all ranks (through the host group); a no-op in single-process mode."""
        if self._world_size > 1 and self.is_distributed:
            dist.barrier(group=self._host_group)

    def wait_world(self) -> None:
        """Wait until this rank's device has finished its queued work, then for all ranks (barrier).

        The device sync first, so that "every rank passed" also means "every rank's kernels and
        collectives issued so far have completed" (e.g. before timing, or before reading files other
        ranks wrote from the device).
        """
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.barrier()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on rank 0 first, then on all other ranks (e.g. download, then read)."""
        with self._first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each node's local rank 0 first, then on the node's other ranks."""
        with self._first(self.is_local_main_process):
            yield

    @contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.barrier()
        try:
            yield
        finally:
            if leader:
                self.barrier()

    def set_timeout(self, seconds: float) -> None:
        """Set the collective timeout of every process group this context uses.

        Changes the default group, the host group and the groups of every mesh dimension of every
        domain, for collectives issued from now on (e.g. a long timeout around checkpoint loading,
        a short one for the training steps). A no-op in single-process mode.
        """
        if seconds <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
        if not self.is_distributed:
            return
        # torch >= 2.12 has dist.set_timeout; earlier releases the private _set_pg_timeout.
        set_pg_timeout = getattr(dist, "set_timeout", None) or getattr(
            dist.distributed_c10d, "_set_pg_timeout", None
        )
        if set_pg_timeout is None:
            raise NotImplementedError(f"torch {torch.__version__} cannot change a process group's timeout")
        delta = timedelta(seconds=seconds)
        groups: dict[int, dist.ProcessGroup] = {}
        for group in [dist.group.WORLD, self._host_group]:
            if group is not None:
                groups[id(group)] = group
        for mesh in self._meshes.values():
            for name in mesh.mesh_dim_names or ():
                group = mesh.get_group(name)
                groups[id(group)] = group
        for group in groups.values():
            set_pg_timeout(delta, group)

    # -- teardown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Destroy the groups this context created (a reused default group is left alone). Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        self._meshes.clear()
        if not dist.is_initialized():
            return
        if self._owns_default_group:
            release_cuda_graphs()  # every group goes with the default one
            dist.destroy_process_group()
        elif self._owns_host_group and self._host_group is not None:
            dist.destroy_process_group(self._host_group)
        self._host_group = None

    def __enter__(self) -> DistributedContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"DistributedContext(rank={self._rank}, world_size={self._world_size}, "
            f"device={self._device}, coordinates={self.coordinates('regular')})"
        )


def _attempt_store(world_size: int, timeout: timedelta | None) -> dist.Store | None:
    """Under a torchrun agent that shares its store with the workers (``TORCHELASTIC_USE_AGENT_STORE``), that
    store with the keys of this restart attempt under a prefix of their own; None elsewhere (env:// as usual).

    torchrun keeps one store for every restart of a group: without the prefix, a restarted rank may read
    the dead group's keys (a peer's old address) and fail to connect ("connectFullMesh ... Connection
    refused") or wait forever. One node's workers share one restart count; across nodes the counts may
    differ, so multi-node restarts also need ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a store per attempt).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT", 29500),
        world_size,
        is_master=False,
        timeout=timeout or timedelta(minutes=30),
    )
    return dist.PrefixStore(f"plait/attempt_{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}", store)
