"""The trainer's subcommands, one module each, registered here and only here: `tokenmill train` (train.py),
`tokenmill launch` (launch.py), `tokenmill model info|compile` (model.py), `tokenmill ladder` (ladder.py),
`tokenmill eval` (eval.py)."""

from __future__ import annotations

import argparse

from tokenmill.trainer.commands import eval as eval_command
from tokenmill.trainer.commands import ladder, launch, model, train


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this stage's subcommands to the `tokenmill` parser."""
    train.register(subparsers)
    launch.register(subparsers)
    model.register(subparsers)
    ladder.register(subparsers)
    eval_command.register(subparsers)
