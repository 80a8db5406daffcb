"""The job layer of the ``plait`` meta-package: the training job as a config, a builder and a command.

:class:`JobConfig` (the loop's sections plus the model of any family, its parallel plan and the data),
:func:`build_job` (the model provider, the data and the task, as one frozen :class:`TrainingJob`), and the
``plait`` command (``train``, ``finetune``, ``tokenize``, ``export``, ``config``, ``info``).
"""

import multiprocessing
import signal

if multiprocessing.current_process().name != "MainProcess":
    # A process that multiprocessing spawns from the job (DCP's checkpoint writer) imports the job's main
    # module again, and with it this package, first thing: there SIGINT is ignored. A Ctrl-C reaches every
    # process of the terminal's group; the job decides what it means (finish the step, save, exit 130).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

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
