"""The agent (launcher) and the rank side (trainer_shim) meet only in ftlaunch_contract."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from conftest import ROOT


def _imports(package: str) -> dict[str, set[str]]:
    """Every module a package's files import, by file."""
    found = {}
    for path in sorted((ROOT / package).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        found[path.name] = names
    return found


@pytest.mark.parametrize("package, other", [("launcher", "trainer_shim"),
                                            ("trainer_shim", "launcher"),
                                            ("ftlaunch_contract", "launcher"),
                                            ("ftlaunch_contract", "trainer_shim")])
def test_packages_meet_only_in_the_contract(package, other):
    crossing = {f: sorted(n for n in names if n == other or n.startswith(other + "."))
                for f, names in _imports(package).items()}
    assert not {f: n for f, n in crossing.items() if n}, f"{package} imports {other}"


def test_the_contract_imports_neither_torch_nor_zmq():
    heavy = {f: sorted(n for n in names if n.split(".")[0] in ("torch", "zmq"))
             for f, names in _imports("ftlaunch_contract").items()}
    assert not {f: n for f, n in heavy.items() if n}


def test_import_trainer_shim_without_an_agent_loads_no_zmq_nor_the_launcher():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTLAUNCH_")}
    env["PYTHONPATH"] = str(ROOT)
    probe = ("import sys, trainer_shim; print(sorted(m for m in sys.modules "
             "if m.split('.')[0] in ('zmq', 'launcher', 'torch', 'msgpack') "
             "or m == 'ftlaunch_contract.messages'))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module", ["recovery", "membership", "hang_detection", "commits",
                                    "node_policy"])
def test_decision_modules_are_pure(module):
    """The decisions are functions of what they are given: no sockets, processes or torch
    anywhere in what they import, so they are tested without any."""
    probe = (f"import sys, launcher.{module}; print(sorted(m for m in ('zmq', 'torch', "
             "'subprocess', 'socket', 'psutil') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"
