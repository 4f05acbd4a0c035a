"""Rendering the site's pages: the Jinja2 environment (autoescaping everything), the inline style and
script with the script's hash for the Content-Security-Policy, and the generator mark by which a later
report recognises a folder an earlier one wrote (`check_output`, `is_earlier_page`)."""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from importlib import resources
from typing import Any

import jinja2

from tokenmill import __version__, storage
from tokenmill.reports.inputs import InputError

GENERATOR = "tokenmill report"


@functools.cache
def _environment() -> jinja2.Environment:
    """The one environment of the process: it keeps the compiled templates, so a page republished
    while a run trains (the run page every few minutes) is not compiled again each time."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tokenmill.reports", "templates"),
        # Autoescape everything, whatever the template's extension: document text is data, never markup.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["thousands"] = lambda value: f"{int(value):,}"
    return env


def _asset(name: str) -> str:
    return resources.files("tokenmill.reports").joinpath("templates", name).read_text(encoding="utf-8")


def _script_hash(script: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")


def check_output(output: str) -> None:
    """Refuse to write into a folder that holds something other than an earlier report."""
    if not storage.is_local(output):
        return
    path = storage.local_path(output)
    if os.path.isfile(path):
        raise InputError(f"{output}: is a file; --output must be a folder")
    if not os.path.isdir(path) or not os.listdir(path):
        return
    # An earlier report, or the live run page `tokenmill train --publish` keeps in the same folder.
    for page in ("index.html", "run.html", "swarm.html"):
        if is_earlier_page(os.path.join(path, page)):
            return
    raise InputError(
        f"{output}: folder is not empty and holds no earlier report; choose an empty or new folder"
    )


def is_earlier_page(path: str) -> bool:
    """Whether the local file `path` is a page this module wrote (its generator meta says so)."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as handle:
        return f'<meta name="generator" content="{GENERATOR}' in handle.read(4096)


def render_template(template: str, **context: Any) -> bytes:
    """One page of the site: `template` rendered with the style, the script and its hash, the generator."""
    script = _asset("search.js")
    return (
        _environment()
        .get_template(template)
        .render(
            version=__version__,
            generator=GENERATOR,
            style=_asset("style.css"),
            script=script,
            script_hash=_script_hash(script),
            **context,
        )
        .encode("utf-8")
    )
