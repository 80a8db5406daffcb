"""DCP's ``.metadata`` read without running code: a restricted unpickler and the storage reader using it.

torch reads a checkpoint's ``.metadata`` with a plain ``pickle.load``, so a planted file (a
``__reduce__`` returning ``os.system``) would run when a checkpoint is resumed or exported.
:class:`SafeFileSystemReader`, the reader of every DCP load plait makes, reads it with
:class:`MetadataUnpickler` instead, which builds only what :data:`ALLOWED` lists (DCP's metadata
dataclasses and the torch values in them) and raises :class:`UnsafeCheckpointError`, naming the
file and the refused ``module.name``, for any other global.

:data:`ALLOWED` is the one place that names the classes DCP metadata is made of, torch's private
``_StorageInfo`` among them, as strings: nothing is imported from torch's private modules here.
``tests/loop/checkpoint/test_safe_metadata.py`` reads real checkpoints of the installed torch with
it, so a torch upgrade that pickles another class fails there, naming it.
"""

from __future__ import annotations

import pickle
from typing import IO, Any, cast

import torch
from plait.loop.checkpoint.errors import UnsafeCheckpointError
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["ALLOWED", "METADATA_FILE", "MetadataUnpickler", "SafeFileSystemReader", "load_metadata"]

METADATA_FILE = ".metadata"  # DCP's name for it (``__<rank>.metadata`` when saved without coordination)

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"

# Every global a DCP ``.metadata`` pickle may name, and why it is there. Building any of them runs no
# code of the file's choosing: dataclasses and an enum of plain values, ``torch.Size`` from a tuple,
# a path from strings, a lookup of torch's own layouts by name.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_MD, "Metadata"),  # the file's one top-level object
        (_MD, "TensorStorageMetadata"),  # a tensor's entry of Metadata.state_dict_metadata
        (_MD, "BytesStorageMetadata"),  # a non-tensor (bytes, object) entry
        (_MD, "ChunkStorageMetadata"),  # one saved chunk (a shard's offsets and sizes) of a tensor
        (_MD, "TensorProperties"),  # a tensor's dtype, layout, requires_grad, memory format
        (_MD, "_MEM_FORMAT_ENCODING"),  # the enum TensorProperties pickles its memory format as
        (_MD, "MetadataIndex"),  # the keys of Metadata.storage_data (an item's FQN and chunk)
        (_MD, "StorageMeta"),  # Metadata.storage_meta: the checkpoint and save ids
        (_FS, "_StorageInfo"),  # the values of Metadata.storage_data: an item's file, offset, length
        ("torch", "Size"),  # tensor sizes, chunk offsets and chunk sizes
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, the directory the save was given
        ("pathlib._local", "PosixPath"),  # the same, pickled by Python 3.13 (importable from 3.13 on)
    }
)
# torch pickles a dtype (and a memory format) as the global of its name, ``torch.float32``: allowed
# when that name in torch's own namespace holds a value of one of these types.
_TORCH_VALUES = (torch.dtype, torch.memory_format, torch.layout)


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only what :data:`ALLOWED` lists (and torch's dtypes, memory formats
    and layouts by name); any other global raises :class:`UnsafeCheckpointError` before it is loaded.

    Args:
        file: the pickle, open for binary reading.
        source: what the error names as the file (its path).
    """

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` where allowed, else raise :class:`UnsafeCheckpointError`."""
        if (module, name) in ALLOWED or (
            module == "torch" and isinstance(vars(torch).get(name), _TORCH_VALUES)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata {self.source} is refused: its pickle names {module}.{name}, which DCP "
            "metadata is not made of (a planted or foreign file); nothing of it was run"
        )


def load_metadata(file: IO[bytes], source: str) -> Metadata:
    """Unpickle DCP metadata from ``file`` with :class:`MetadataUnpickler` (``source`` names it in errors)."""
    metadata: Metadata = MetadataUnpickler(file, source).load()
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose :meth:`read_metadata` uses :class:`MetadataUnpickler`
    instead of ``pickle.load``; everything else (the data files, read ``weights_only``) is torch's."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read the checkpoint's ``.metadata`` (``__<rank>.metadata`` with ``rank``), as torch's reader
        does: the same file, and this load's ``load_id`` set in its storage meta.

        Raises:
            UnsafeCheckpointError: the file names a global outside :data:`ALLOWED`.
        """
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(cast(IO[bytes], f), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata
