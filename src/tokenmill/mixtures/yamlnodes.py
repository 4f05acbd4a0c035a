"""Reading mixture YAML safely, keeping the line of every value.

PyYAML's composer gives a node tree with positions and without constructing anything; this module turns
that tree into plain dicts, lists, strings, numbers, booleans and None, recording the line of every path
on the way. It refuses what `yaml.safe_load` would let through silently or what no spec should hold:
duplicate keys (safe_load keeps the last one, so a copied weight silently wins) and any tag other than
the plain YAML types (`!!python/object...`, `!!binary`, local `!tags`), so that loading a spec can never
build an object. Aliases and `<<` merge keys are allowed, with a cap on the expanded size against
alias bombs.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from tokenmill.mixtures.errors import Issue, Lines, MixtureError, Path, format_path

try:  # libyaml's parser is several times faster on large specs; positions are the same.
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

_YAML = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL = (_YAML + t for t in ("str", "int", "float", "bool", "null"))
MAP, SEQ, MERGE, TIMESTAMP = (_YAML + t for t in ("map", "seq", "merge", "timestamp"))

# An expanded document bigger than this is an alias bomb, not a mixture (200 cells need a few thousand).
MAX_NODES = 1_000_000
MAX_DEPTH = 64


def short_tag(tag: str) -> str:
    return "!!" + tag[len(_YAML) :] if tag.startswith(_YAML) else tag


class _Converter:
    def __init__(self, lines: Lines) -> None:
        self.lines = lines
        self.nodes = 0
        self.constructor = SafeConstructor()

    def fail(self, path: Path, node: Node, message: str) -> MixtureError:
        return MixtureError([Issue(format_path(path), message, node.start_mark.line + 1, self.lines.file)])

    def bad_tag(self, path: Path, node: Node) -> MixtureError:
        return self.fail(
            path,
            node,
            f"YAML tag {short_tag(node.tag)} is not allowed: a mixture holds only mappings, lists, "
            "strings, numbers and booleans",
        )

    def convert(self, node: Node, path: Path, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail(path, node, f"document expands to more than {MAX_NODES:,} values (alias bomb?)")
        if depth > MAX_DEPTH:
            raise self.fail(path, node, f"nested deeper than {MAX_DEPTH} levels (recursive alias?)")
        self.lines.values.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, MappingNode):
            if node.tag != MAP:
                raise self.bad_tag(path, node)
            return self.mapping(node, path, depth)
        if isinstance(node, SequenceNode):
            if node.tag != SEQ:
                raise self.bad_tag(path, node)
            return [self.convert(child, (*path, i), depth + 1) for i, child in enumerate(node.value)]
        return self.scalar(node, path)

    def scalar(self, node: Node, path: Path) -> Any:
        tag = node.tag
        # An unquoted date resolves to !!timestamp implicitly; a spec wants the text, not a datetime.
        if tag in (STR, TIMESTAMP):
            return node.value
        if tag == INT:
            return self.constructor.construct_yaml_int(node)
        if tag == FLOAT:
            return self.constructor.construct_yaml_float(node)
        if tag == BOOL:
            return self.constructor.construct_yaml_bool(node)
        if tag == NULL:
            return None
        raise self.bad_tag(path, node)

    def mapping(self, node: MappingNode, path: Path, depth: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        merges: list[Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == MERGE:
                merges.append(value_node)
                continue
            if not isinstance(key_node, ScalarNode):
                raise self.fail(path, key_node, "mapping keys must be plain strings")
            if key_node.tag not in (STR, INT, FLOAT, BOOL, NULL, TIMESTAMP):
                raise self.bad_tag(path, key_node)
            key = key_node.value
            key_path = (*path, key)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise self.fail(key_path, key_node, f"duplicate key (first at line {first_line[key]})")
            first_line[key] = line
            self.lines.keys.setdefault(key_path, line)
            result[key] = self.convert(value_node, key_path, depth + 1)
        # `<<: *base` fills in keys the mapping does not set itself; the first merged mapping wins.
        for merge in merges:
            for source in merge.value if isinstance(merge, SequenceNode) else [merge]:
                if not isinstance(source, MappingNode) or source.tag != MAP:
                    raise self.fail(path, source, "'<<' merges only mappings")
                for key, value in self.mapping(source, path, depth + 1).items():
                    result.setdefault(key, value)
        return result


def load_yaml(text: str, file: str | None = None) -> tuple[Any, Lines]:
    """Parse one YAML document into plain data and the line of each path; MixtureError if unsafe or bad."""
    lines = Lines(file)
    try:
        documents = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        problem = " ".join(part for part in (error.context, error.problem) if part)
        raise MixtureError(
            [Issue("", f"not valid YAML: {problem}", mark.line + 1 if mark else None, file)]
        ) from None
    except yaml.YAMLError as error:
        raise MixtureError([Issue("", f"not valid YAML: {error}", None, file)]) from None
    documents = [document for document in documents if document is not None]
    if not documents:
        raise MixtureError([Issue("", "empty file: a mixture is a mapping of fields", 1, file)])
    if len(documents) > 1:
        second = documents[1].start_mark.line + 1
        raise MixtureError(
            [Issue("", "more than one YAML document ('---'); give one mixture per file", second, file)]
        )
    return _Converter(lines).convert(documents[0], (), 0), lines
