"""The package's shape (issue 17, src/tokenmill/__init__.py): imports run downward only, trainer and reports
never reach Apache Beam, no import cycle anywhere, the trainer's parts keep their places (issue 33), and
the package finds its own data inside itself, not in a checkout.

Imports are read with `ast` from every source file, function-level imports included (a lazy import is
still an edge), so that a new upward import fails here whether or not any test happens to run it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from importlib import resources
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "src"

#: The bottom of the package: anything may import these; they import only one another.
BOTTOM = {"errors", "storage", "units", "cells", "validation", "formats"}
#: Reading raw input (JSON Lines, Parquet, WARC): the bottom's first user, below every stage that reads
#: documents (curate, the domain classifier's training, evaluation sets); never imports Beam.
CORPORA = {"corpora"}
#: The stages that make the files; they import the bottom, corpora and one another (in no cycle).
STAGES = {"pipelines", "filters", "tokenize", "mixtures", "domains"}
#: Readers of the files; they never import Beam, however indirectly.
READERS = {"trainer", "reports"}
#: Mixture search: above the trainer (it writes run configurations and starts `tokenmill train`); nothing
#: imports it but the command line, and the pages read its records through tokenmill.formats.swarm.
SEARCH = {"swarm"}
#: Exports of trained checkpoints (tokenmill export/import hf): above the trainer, whose checkpoints and
#: model it reads; nothing imports it but the command line.
EXPORT = {"export"}
#: The trainer's parts (docs/trainer.md): what each may import of the trainer besides itself.
TRAINER = "tokenmill.trainer"
TRAINER_PARTS = {
    "model": set(),  # the model imports nothing else of the trainer
    "data": set(),  # data never imports the model or the run
    "run": {"model", "data"},
    "ladder": {"model", "run"},
    "commands": {"model", "data", "run", "ladder"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted((SOURCE / "tokenmill").rglob("*.py"))}


@cache
def imports_of(module: str) -> frozenset[str]:
    """Every module `module` imports anywhere in its file, as absolute names (`from a import b` gives a and,
    when b is a module of the package, a.b)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(), str(MODULES[module]))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{MODULES[module]}:{node.lineno}: a relative import"
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(found)


def package_imports(module: str) -> set[str]:
    """The package's modules that `module` imports (each with the packages above it, whose __init__ runs)."""
    result = set()
    for name in imports_of(module):
        parts = name.split(".")
        result.update(".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in MODULES)
    return result


def layer(module: str) -> str:
    """The top-level name under tokenmill: `formats` for tokenmill.formats.plan, `cli` for tokenmill.cli."""
    return module.split(".")[1] if module != "tokenmill" else ""


def reaches_beam(module: str) -> list[str]:
    """A chain of imports from `module` to apache_beam, or [] when there is none."""
    parents: dict[str, str | None] = {module: None}
    queue = [module]
    while queue:
        current = queue.pop(0)
        if any(name.split(".")[0] == "apache_beam" for name in imports_of(current)):
            chain = [current]
            while parents[chain[-1]] is not None:
                chain.append(parents[chain[-1]])
            return [*reversed(chain), "apache_beam"]
        for imported in sorted(package_imports(current)):
            if imported not in parents:
                parents[imported] = current
                queue.append(imported)
    return []


def test_the_package_has_the_layers_the_rule_names():
    layers = {layer(module) for module in MODULES} - {"", "cli", "__main__"}
    assert layers == BOTTOM | CORPORA | STAGES | READERS | SEARCH | EXPORT | {"samples"}


@pytest.mark.parametrize(
    ("layers", "allowed"),
    [
        (BOTTOM, BOTTOM),
        ({"samples"}, BOTTOM | {"samples"}),
        (CORPORA, BOTTOM | CORPORA),
        (STAGES, BOTTOM | CORPORA | STAGES),
        (READERS, BOTTOM | CORPORA | STAGES | READERS),
        (SEARCH, BOTTOM | CORPORA | STAGES | READERS | SEARCH),
        (EXPORT, BOTTOM | CORPORA | STAGES | READERS | EXPORT),
    ],
    ids=["bottom", "samples", "corpora", "stages", "trainer-and-reports", "search", "export"],
)
def test_imports_run_downward(layers, allowed):
    wrong = {
        f"{module} imports {imported}"
        for module in MODULES
        if layer(module) in layers
        for imported in package_imports(module)
        if layer(imported) not in allowed | {""}
    }
    assert not wrong, sorted(wrong)


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports. A module's own packages are left out: Python runs their
    __init__ before the module whatever it imports, so a package that imports its own modules is no cycle."""
    return {module: package_imports(module) - _ancestors(module) - {module} for module in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(group)
    return found


def sibling_graphs() -> dict[str, dict[str, set[str]]]:
    """For every package, its children (modules and sub-packages) and which of them import which: a loop
    between two sub-packages is a cycle even when no two modules import each other."""
    graph = import_graph()
    result = {}
    for package in (m for m in MODULES if MODULES[m].name == "__init__.py"):
        depth = package.count(".") + 1
        owner = {m: ".".join(m.split(".")[: depth + 1]) for m in MODULES if m.startswith(package + ".")}
        siblings: dict[str, set[str]] = {child: set() for child in owner.values()}
        for module, child in owner.items():
            siblings[child] |= {owner[i] for i in graph[module] if i in owner and owner[i] != child}
        result[package] = siblings
    return result


def all_cycles() -> list[list[str]]:
    groups = cycles(import_graph())
    for siblings in sibling_graphs().values():
        groups += cycles(siblings)
    return [sorted(group) for group in groups]


def test_no_import_cycle_anywhere():
    # Function-level (lazy) imports count: a cycle hidden by one is still a cycle.
    assert all_cycles() == []


def test_the_cycle_rule_would_catch_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def trainer_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if module.startswith(TRAINER + ".") and len(parts) > 2 else None


def test_the_trainer_has_the_parts_the_rule_names():
    parts = {trainer_part(module) for module in MODULES if trainer_part(module)}
    assert parts == set(TRAINER_PARTS)
    # Every trainer module lives in a part: nothing left loose beside them.
    assert {m for m in MODULES if m.startswith(TRAINER + ".") and not trainer_part(m)} == set()


@pytest.mark.parametrize("part", sorted(TRAINER_PARTS))
def test_each_trainer_part_imports_only_what_it_may(part):
    allowed = TRAINER_PARTS[part] | {part}
    wrong = {
        f"{module} imports {imported}"
        for module in MODULES
        if trainer_part(module) == part
        for imported in package_imports(module)
        if trainer_part(imported) is not None and trainer_part(imported) not in allowed
    }
    assert not wrong, sorted(wrong)


def test_command_modules_are_imported_only_by_the_command_registry():
    registry = f"{TRAINER}.commands"
    importers = {
        f"{module} imports {imported}"
        for module in MODULES
        if module != registry
        for imported in package_imports(module)
        if imported.startswith(registry + ".") and imported not in _ancestors(module)
    }
    assert not importers, sorted(importers)


def test_the_trainer_map_names_every_module():
    # docs/trainer.md, "Where things are": one row per part, naming each of its modules.
    text = (REPO / "docs" / "trainer.md").read_text()
    section = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1].rstrip("/"): line for line in section.splitlines() if line.startswith("| `")}
    assert set(rows) == set(TRAINER_PARTS)
    missing = [
        module
        for module, path in MODULES.items()
        if trainer_part(module)
        and path.name != "__init__.py"
        and f"`{path.name}`" not in rows[trainer_part(module)]
    ]
    assert not missing, f"docs/trainer.md's map does not name {missing}"


def test_only_main_imports_the_command_line():
    # Commands raise tokenmill.errors.UsageError; none imports it (or anything) from cli.py.
    importers = {module for module in MODULES if "tokenmill.cli" in package_imports(module)}
    assert importers == {"tokenmill.__main__"}


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if layer(m) in READERS | CORPORA | BOTTOM | {"samples"})
)
def test_trainer_and_reports_never_reach_beam(module):
    assert reaches_beam(module) == []


def test_the_rule_would_catch_beam_reached_through_a_stage():
    # The check is not vacuous: tokenize's command reaches Beam through the pipeline it runs.
    chain = reaches_beam("tokenmill.pipelines.tokenize_command")
    assert (
        chain[0] == "tokenmill.pipelines.tokenize_command" and chain[-1] == "apache_beam" and len(chain) > 2
    )


def test_training_and_the_page_load_without_beam():
    # At run time too: the sampler, the remote reader, the ladder and the report site import no Beam.
    code = (
        "import sys\n"
        "import tokenmill.trainer.data.sampler, tokenmill.trainer.ladder, tokenmill.trainer.commands.ladder\n"
        "import tokenmill.reports.site, tokenmill.reports.commands, tokenmill.formats.plan\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'apache_beam'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_no_module_walks_up_from_its_own_file():
    # The package's data is found with importlib.resources: a path built from a module's own __file__, or
    # Path(...).parents[n] up to a checkout, breaks an installed package.
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            walks_up = (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "parents"
            )
            if walks_up or (isinstance(node, ast.Name) and node.id == "__file__"):
                pytest.fail(f"{path}:{node.lineno} builds a path from a source file's place")


def test_bundled_configs_ship_inside_the_package_and_equal_configs():
    # src/tokenmill/configs/ is a copy of what an installed package needs from configs/ (the folder users
    # edit): a change to one without the other fails here.
    packaged = resources.files("tokenmill").joinpath("configs")
    copies = sorted(path for path in (SOURCE / "tokenmill" / "configs").rglob("*") if path.is_file())
    assert copies, "no configs inside the package"
    for copy in copies:
        relative = copy.relative_to(SOURCE / "tokenmill" / "configs")
        assert (
            packaged.joinpath(*relative.parts).read_bytes() == (REPO / "configs" / relative).read_bytes()
        ), f"src/tokenmill/configs/{relative} differs from configs/{relative}: copy the one you changed"
    from tokenmill.filters.classifiers import default_config, load_config

    for kind in ("domain", "quality"):
        assert load_config(default_config(kind)) == load_config(
            REPO / "configs" / "classifiers" / f"{kind}.yaml"
        )


def test_bench_scripts_and_tests_do_not_edit_sys_path():
    # They import the installed package (tokenmill.samples for the generated data), never a folder.
    # The one exception: bench/extract.py's optional comparison with trafilatura, a third-party package in
    # a folder the user names, put after the environment's packages.
    edit = re.compile(r"\bsys\.path\.(insert|append|extend)\(|\bsys\.path\s*=")
    edits = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in ("bench", "scripts", "tests")
        for path in sorted((REPO / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if edit.search(line) and "args.trafilatura_path" not in line
    ]
    assert edits == [], edits
