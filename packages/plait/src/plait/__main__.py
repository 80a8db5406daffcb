"""``python -m plait`` (and ``torchrun ... -m plait train``): the ``plait`` command."""

from plait.train.cli import main

main()
