"""The `tokenmill` command line: one subcommand per stage.

Each stage's package owns its subcommands in a `commands` module with a `register(subparsers)` function.
Registration only declares arguments; heavy imports (Beam, JAX) happen inside the handlers, so that
`tokenmill --help` and small commands start quickly.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys
import threading
from typing import NoReturn

from tokenmill import __version__
from tokenmill.errors import UsageError

# The order here is the order in `tokenmill --help`.
COMMAND_MODULES = (
    "tokenmill.pipelines.commands",
    "tokenmill.filters.classifier_commands",
    "tokenmill.domains.commands",
    "tokenmill.filters.commands",
    "tokenmill.tokenize.commands",
    "tokenmill.pipelines.tokenize_command",
    "tokenmill.mixtures.commands",
    "tokenmill.swarm.commands",  # adds to `tokenmill mixture`
    "tokenmill.trainer.commands",
    "tokenmill.export.commands",  # tokenmill export hf, tokenmill import hf
    "tokenmill.reports.commands",
)

#: The optional extra that brings each module a command may need; a plain install names it when missing.
EXTRA_OF_MODULE = {
    "jax": "train",
    "jaxlib": "train",
    "optax": "train",
    "orbax": "train",
    "ml_dtypes": "train",
    "safetensors": "train",
    "sklearn": "train",
    "dask": "dask",
    "distributed": "dask",
    "pynvml": "gpu",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill",
        description="Raw text to a trained mixture-of-experts model: curate, tokenize, mix, train, report.",
    )
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not args.verbose:
        # Beam's local runner relays every worker's INFO lines; they drown the progress that matters.
        for noisy in ("apache_beam", "absl", "jax._src"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        # ...and relays worker start-up warnings about features tokenmill does not use.
        logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except UsageError as error:
        print(f"tokenmill {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        extra = EXTRA_OF_MODULE.get((error.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"tokenmill {args.command}: error: this command needs {error.name}, which the {extra!r} extra "
            f"installs: pip install 'tokenmill[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `tokenmill` program: `main()`, then an exit without Python's teardown.

    A curate launcher holds Beam's job graph, its protos and every module it imported, and Python's
    teardown frees them object by object: 0.7-0.8 s measured after a curate run on the development
    machine, longer than the run's last stages. By the time main() returns every file is written; the
    exit handlers still run (they close sessions, end multiprocessing children, flush logging), the
    streams are flushed, and the operating system reclaims the memory at once. Where a thread that is
    not a daemon is still alive, Python's own exit waits for it as usual.
    """
    code = main()
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()[1:]):
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
