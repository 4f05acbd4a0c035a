"""Which files the `--input` patterns name, and what each is called in documents and ids.

A document's `source` is its input file's path relative to the input root (`input_root`: the common
folder of the `--input` patterns), '/'-separated, so `crawl-01/part.jsonl` and `crawl-02/part.jsonl`
stay apart, and the same files under a local folder or under gs://bucket/prefix get the same names.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from tokenmill import storage
from tokenmill.errors import UsageError

_GLOB_CHARACTERS = "*?["


def expand_inputs(patterns: list[str]) -> list[str]:
    """Every file the patterns name, in sorted order; a pattern that matches nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        matches = storage.expand_glob(pattern)
        if not matches:
            is_folder = storage.is_local(pattern) and os.path.isdir(storage.local_path(pattern))
            what = "is a folder; give a glob such as DIR/*.jsonl.zst" if is_folder else "matches no file"
            raise UsageError(f"--input {pattern!r} {what}")
        files.extend(matches)
    return sorted(dict.fromkeys(files))


def _split_path(path: str) -> tuple[str, list[str]]:
    """(protocol, path components): '' and the absolute path's parts for a local path."""
    if storage.is_local(path):
        absolute = os.path.abspath(storage.local_path(path))
        return "", [part for part in absolute.split(os.sep) if part]
    protocol, rest = path.split("://", 1)
    rest = rest.strip("/")
    # Inner empty components stay: `a//b` and `a/b` are different objects in a bucket.
    return protocol, rest.split("/") if rest else []


def _join_path(protocol: str, parts: list[str]) -> str:
    return f"{protocol}://{'/'.join(parts)}" if protocol else "/" + "/".join(parts)


def common_root(folders: Iterable[str]) -> str:
    """The deepest folder that holds all of `folders` (local or remote), or '' when they share none
    (different protocols)."""
    split = [_split_path(folder) for folder in folders]
    if not split or len({protocol for protocol, _ in split}) != 1:
        return ""
    protocol = split[0][0]
    shared = split[0][1]
    for _, parts in split[1:]:
        length = 0
        while length < min(len(shared), len(parts)) and shared[length] == parts[length]:
            length += 1
        shared = shared[:length]
    return _join_path(protocol, shared)


def _folder(path: str) -> str:
    """The folder part of a path: up to its last '/' (a remote path's protocol root if it has none)."""
    if not storage.is_local(path) and "/" not in path.split("://", 1)[1]:
        return path.split("://", 1)[0] + "://"  # e.g. a glob in the bucket name
    return path[: path.rfind("/") + 1] if "/" in path else "."


def input_root(patterns: Iterable[str]) -> str:
    """The folder that input sources are named relative to: the common root of the folder part of each
    pattern before its first glob character ('/data/crawl-*/part.jsonl' -> '/data').

    Local roots are absolute; remote ones keep their protocol (gs://bucket/prefix). The same layout
    under a local folder and under a bucket prefix gives the same relative names.
    """
    folders = []
    for pattern in patterns:
        cut = min((pattern.find(c) for c in _GLOB_CHARACTERS if c in pattern), default=len(pattern))
        folders.append(_folder(pattern[:cut]))
    return common_root(folders)


def common_file_root(paths: Iterable[str]) -> str:
    """The common root of the folders of `paths` (for callers that have files, not patterns: a file
    name's `[` is not a glob character here)."""
    return common_root(_folder(path) for path in paths)


def relative_source(path: str, root: str | None) -> str:
    """The `source` of an input file: its path below `root`, '/'-separated (its basename if root is None).

    Raises ValueError for a path outside `root`: names would not be unique there.
    """
    if root is None:
        return os.path.basename(path.rstrip("/"))
    protocol, parts = _split_path(path)
    if root == "":  # inputs with nothing in common (different protocols): the full path names the file
        return _join_path(protocol, parts).lstrip("/")
    root_protocol, root_parts = _split_path(root)
    if protocol != root_protocol or parts[: len(root_parts)] != root_parts or len(parts) == len(root_parts):
        raise ValueError(f"{path} is not below the input root {root}")
    return "/".join(parts[len(root_parts) :])
