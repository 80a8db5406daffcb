"""The job layer of the ``plait`` meta-package: the training job as a config, a builder and a command.

:class:`JobConfig` (the loop's sections plus the model of any family, its parallel plan and the data),
:func:`build_job` (the model provider, the data and the task, as one frozen :class:`TrainingJob`), and the
``plait`` command (``train``, ``finetune``, ``tokenize``, ``export``, ``config``, ``info``).
"""

from plait.train.config import JobConfig, StartupError
from plait.train.job import (
    TrainingJob,
    adopt_checkpoint_config,
    build_job,
    build_provider,
    check_corpus,
    check_startup,
)

__all__ = [
    "JobConfig",
    "StartupError",
    "TrainingJob",
    "adopt_checkpoint_config",
    "build_job",
    "build_provider",
    "check_corpus",
    "check_startup",
]
