"""Saves once with async_mode="process" in a one-rank gloo job and prints the writer process's
listening TCP sockets as JSON (``[[address, port], ...]``); the loopback test drives it.

Usage: python _process_store_script.py ROOT PORT|none. With ``none`` the job has no MASTER_ADDR /
MASTER_PORT (a one-process group on an in-memory store, as a single-process plait job has).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from plait.loop.checkpoint import Checkpointer
from torch.distributed.checkpoint import _async_process_executor as ape


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # /proc prints each 32-bit word host-endian
    return ":".join(b"".join(words)[i : i + 2].hex() for i in range(0, 16, 2))


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                addr, port = local.split(":")
                out.append((_address(addr), int(port, 16)))
    return out


def main() -> None:
    root, port = sys.argv[1], sys.argv[2]
    if port == "none":
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    ck = Checkpointer(root, async_mode="process")
    ck.save(1, {"w": torch.arange(8.0)})
    ck.finalize()
    assert ape._CHECKPOINT_PROCESS is not None
    print(json.dumps(listening_sockets(ape._CHECKPOINT_PROCESS._save_process.pid)), flush=True)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
