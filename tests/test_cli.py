"""The command line's own behaviour: a command whose optional extra is missing names the extra to install."""

from __future__ import annotations

import sys

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
