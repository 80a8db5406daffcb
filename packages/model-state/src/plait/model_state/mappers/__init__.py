"""Declarative checkpoint mappers: each declares its dependency groups before any byte is read."""

from .base import (
    PASS_THROUGH,
    GroupFn,
    KeyReport,
    Mapper,
    MapperGroup,
    Plan,
    Slicer,
    join_slicer,
    plan_groups,
    rekey,
)
from .chunk import Chunk, Concatenate
from .composite import Parallel, RankShard, Sequential
from .distribute import Distribute, Gather
from .keys import AddPrefix, Drop, Identity, Rename, Scoped, Select
from .stack import Stack, Unstack
from .templates import KeyTemplate
from .tensor_ops import Cast, Deinterleave, Interleave, Reshape, Transpose

__all__ = [
    "PASS_THROUGH",
    "AddPrefix",
    "Cast",
    "Chunk",
    "Concatenate",
    "Deinterleave",
    "Distribute",
    "Drop",
    "Gather",
    "GroupFn",
    "Identity",
    "Interleave",
    "KeyReport",
    "KeyTemplate",
    "Mapper",
    "MapperGroup",
    "Parallel",
    "Plan",
    "RankShard",
    "Rename",
    "Reshape",
    "Scoped",
    "Select",
    "Sequential",
    "Slicer",
    "Stack",
    "Transpose",
    "Unstack",
    "join_slicer",
    "plan_groups",
    "rekey",
]
