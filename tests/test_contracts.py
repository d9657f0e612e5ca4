"""The package's shape as checked rules: import contracts (import-linter, `.importlinter`) and
"only optim writes p.grad" (an AST check, since it is not an import rule)."""
from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dynamix_hvd"
CONFIG = REPO / ".importlinter"


def lint_imports() -> str:
    """The `lint-imports` of this interpreter's environment (or on PATH); fails clearly when absent."""
    here = Path(sys.executable).parent / "lint-imports"
    exe = str(here) if here.is_file() else shutil.which("lint-imports")
    assert exe, ("import-linter is not installed, so the import contracts cannot be checked: "
                 "pip install import-linter (it is in the 'test' extra and in launch/setup_env.sh)")
    return exe


def test_import_contracts_hold():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([lint_imports(), "--config", str(CONFIG), "--no-cache"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"import contracts broken (see {CONFIG.name}):\n{proc.stdout[-6000:]}{proc.stderr}"
    assert "0 broken" in proc.stdout, proc.stdout[-3000:]


def test_decision_core_contract_names_every_pure_control_module():
    """The contract lists control's modules one by one (the controller is excluded); a new module
    must be added there, or this fails."""
    cfg = configparser.ConfigParser()
    cfg.read(CONFIG)
    listed = set(cfg["importlinter:contract:decision-core"]["source_modules"].split())
    modules = {f"dynamix_hvd.control.{p.stem}" for p in (PACKAGE / "control").glob("*.py")
               if p.stem not in ("__init__", "controller")}
    assert modules - listed == set(), f"add to the decision-core contract in {CONFIG.name}: {modules - listed}"


# --- only optim writes p.grad ------------------------------------------------------------------------
def _touches_grad(node: ast.AST) -> bool:
    """Does this expression go through a ``.grad`` attribute (p.grad, p.grad.data, p.grad[i], ...)?"""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        if isinstance(node, ast.Attribute) and node.attr == "grad":
            return True
        node = node.value
    return False


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.Tuple, ast.List)):
        return [t for elt in node.elts for t in _targets(elt)]
    return [node]


def grad_writes(source: str, filename: str = "<src>") -> list[str]:
    """Every place in `source` that assigns, deletes or mutates in place a ``.grad``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        hits: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            hits = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            hits = _targets(node.target)
        elif isinstance(node, ast.Delete):
            hits = [t for target in node.targets for t in _targets(target)]
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr.endswith("_") and not func.attr.startswith("__"):
                hits = [func.value]  # p.grad.mul_(...), p.grad.data.copy_(...), p.grad[0].zero_()
            hits += [kw.value for kw in node.keywords if kw.arg == "out"]  # torch.add(a, b, out=p.grad)
            if isinstance(func, ast.Name) and func.id == "setattr" and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value == "grad":
                found.append(f"{filename}:{node.lineno}: setattr(..., 'grad', ...)")
        found += [f"{filename}:{node.lineno}: {ast.unparse(node).splitlines()[0]}"
                  for t in hits if _touches_grad(t)]
    return found


@pytest.mark.parametrize("line", [
    "p.grad = g", "p.grad += g", "p.grad: Tensor = g", "a, p.grad = 1, g", "p.grad.data = g", "p.grad[0] = 1",
    "del p.grad", "p.grad.mul_(2)", "p.grad.copy_(g)", "p.grad.add_(g)", "p.grad.zero_()", "p.grad.data.div_(2)",
    "torch.add(a, b, out=p.grad)", "setattr(p, 'grad', g)", "model.fc.weight.grad.clamp_(-1, 1)",
])
def test_the_grad_check_sees_every_kind_of_write(line):
    assert grad_writes(line), line


@pytest.mark.parametrize("line", ["g = p.grad", "n = p.grad.norm()", "x = p.grad.clone().mul_(2)",
                                  "p.requires_grad_(False)", "loss.backward()", "self.grad_norm = 1.0"])
def test_the_grad_check_lets_reads_through(line):
    assert grad_writes(line) == [], line


def test_only_optim_writes_grad():
    writes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "optim") in path.parents:
            continue
        writes += grad_writes(path.read_text(), str(path.relative_to(REPO)))
    assert writes == [], "only dynamix_hvd/optim may write p.grad; found:\n" + "\n".join(writes)
