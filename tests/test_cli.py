"""The command line's own behaviour: a command whose optional extra is missing names the extra to install;
the program exits with its command's status, its output flushed, without Python's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tokenmill.cli import main


def test_a_missing_extra_is_named_with_its_install_command(monkeypatch, tmp_path, capsys):
    # As on a plain `pip install .`: the export's bf16 type is not importable, so neither is the exporter.
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    for module in ("tokenmill.export.hf", "tokenmill.export.tensors"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    code = main(["export", "hf", "--run", str(tmp_path / "run"), "--output", str(tmp_path / "hf")])
    error = capsys.readouterr().err
    assert code == 2
    assert "needs ml_dtypes" in error and "pip install 'tokenmill[train]'" in error, error


def test_a_missing_module_outside_the_extras_is_not_hidden(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenmill.export.hf", None)
    with pytest.raises(ModuleNotFoundError) as raised:
        main(["export", "hf", "--run", str(tmp_path / "run"), "--output", str(tmp_path / "hf")])
    assert raised.value.name == "tokenmill.export.hf"


def test_the_program_exits_with_the_commands_status_and_its_output_flushed(tmp_path):
    version = subprocess.run([sys.executable, "-m", "tokenmill", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("tokenmill ")
    missing = tmp_path / "missing.yaml"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill",
            "curate",
            "--recipe",
            str(missing),
            "--input",
            "x",
            "--output",
            "y",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr, bad.stderr
    # Exit handlers still run, and a thread that is not a daemon is waited for.
    script = textwrap.dedent(
        f"""
        import atexit, sys, threading, time
        import tokenmill.cli as cli
        marker = {str(tmp_path / "marker")!r}
        atexit.register(lambda: open(marker, "a").write("atexit "))
        def late():
            time.sleep(0.5)
            open(marker, "a").write("thread ")
        def main():
            threading.Thread(target=late).start()
            print("printed, not yet flushed", end="")
            return 3
        cli.main = main
        cli.run()
        """
    )
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert finished.returncode == 3 and finished.stdout == "printed, not yet flushed"
    assert (tmp_path / "marker").read_text() == "thread atexit "
    script = script.replace("threading.Thread(target=late).start()", "pass")
    (tmp_path / "marker").unlink()
    finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert finished.returncode == 3 and finished.stdout == "printed, not yet flushed"
    assert (tmp_path / "marker").read_text() == "atexit "
