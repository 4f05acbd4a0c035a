"""`python -m tokenmill` runs the command line."""

from tokenmill.cli import run

run()
