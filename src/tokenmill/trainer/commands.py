"""Subcommands of the trainer stage, one module each: `tokenmill train` (train_command.py), `tokenmill launch`
(launch.py), `tokenmill model info` (model_command.py) and `tokenmill ladder` (ladder_command.py)."""

from __future__ import annotations

import argparse

from tokenmill.trainer import ladder_command, launch, model_command, train_command


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this stage's subcommands to the `tokenmill` parser."""
    train_command.register(subparsers)
    launch.register(subparsers)
    model_command.register(subparsers)
    ladder_command.register(subparsers)
