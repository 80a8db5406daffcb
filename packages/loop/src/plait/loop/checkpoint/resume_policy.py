"""What a resume may change: the config a checkpoint was saved with against the config resuming it.

Every checkpoint's marker records the run's config (``TrainingCheckpoints`` puts it there). At resume
each field that differs is either refused, when it is in the config class's ``fixed_on_resume``
(shapes, the global batch, the sequence length, the data order and seed), or allowed and logged
(learning rate and schedule, weight decay, clipping, cadences, steps, ...). Allowed optimizer
hyper-parameters are applied by the trainer over the ones the optimizer's state brought back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from plait.loop.config import ConfigError

__all__ = ["ResumeConfigError", "check_resume_config", "config_changes"]

log = logging.getLogger("plait.loop")


class ResumeConfigError(ConfigError):
    """The run's config cannot resume this checkpoint; the message names each field and both values
    (or the checkpoint's step and ``run.steps``)."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted field -> (saved value, current value) for every field that differs (a field only one
    side has counts, with ``None`` on the other)."""
    a, b = _flatten(saved), _flatten(current)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _fixed(field: str, fixed: Iterable[str]) -> bool:
    return any(field == f or field.startswith(f"{f}.") for f in fixed)


def check_resume_config(
    path: Path, meta: Mapping[str, Any], current: Mapping[str, Any], fixed: Iterable[str], steps: int
) -> dict[str, tuple[Any, Any]]:
    """Check the config ``current`` (``model_dump(mode="json")``) against checkpoint ``path``'s marker.

    Returns the allowed changes (logged here, one line each).

    Raises:
        ResumeConfigError: a changed field under one of ``fixed`` (each named with both values), or a
            checkpoint whose step is past ``steps`` (the run's ``run.steps``).
    """
    step = int(meta.get("step", 0))
    if step > steps:
        raise ResumeConfigError(
            f"checkpoint {path} is at step {step}, past run.steps={steps}: it has already trained "
            f"further than this run asks; give run.steps >= {step} (or another run directory)"
        )
    saved = meta.get("config")
    if not isinstance(saved, Mapping):
        log.warning("checkpoint %s records no config: the settings of this resume are not compared", path)
        return {}
    fixed = tuple(fixed)
    changes = config_changes(saved, current)
    # A field the checkpoint's config does not have at all was added to plait after it was written: the
    # run that wrote it behaved as the field's current value says (its default), unless set otherwise now.
    added = _flatten(current).keys() - _flatten(saved).keys()
    for k in sorted(added & changes.keys()):
        log.warning("checkpoint %s predates the field %s: resuming with %s=%r", path, k, k, changes[k][1])
    refused = [
        f"{k}: {a!r} in the checkpoint, {b!r} now"
        for k, (a, b) in changes.items()
        if _fixed(k, fixed) and k not in added
    ]
    if refused:
        raise ResumeConfigError(
            f"cannot resume from {path}: a resume may not change these fields (they shape the model, "
            "the batches or the data order):\n  " + "\n  ".join(refused)
        )
    for k, (a, b) in changes.items():
        log.info("resume from %s changes %s: %r -> %r", path, k, a, b)
    return changes
