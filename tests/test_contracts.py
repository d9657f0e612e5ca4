"""The package's shape as checked rules: import contracts (import-linter, `.importlinter`), and two
AST checks for rules that are not about imports: "only optim writes p.grad" and "the lab (bench)
uses only the library's public names"."""
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


def test_the_lab_contract_forbids_every_helper_of_the_tests():
    """tests/ is on sys.path (setup.cfg), so its helper modules and packages import by their own
    names: the contract that keeps bench from importing the tests must name each one, or this fails."""
    cfg = configparser.ConfigParser()
    cfg.read(CONFIG)
    forbidden = set(cfg["importlinter:contract:lab-never-imports-the-tests"]["forbidden_modules"].split())
    tests = REPO / "tests"
    helpers = {p.stem for p in tests.glob("*.py") if not p.stem.startswith("test_")}
    helpers |= {p.parent.name for p in tests.glob("*/__init__.py")}
    assert {"launching", "workers"} <= helpers, helpers
    assert helpers | {"tests"} <= forbidden, f"add to lab-never-imports-the-tests in {CONFIG.name}: {helpers - forbidden}"


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


def _imports_of(source: str, prefix: str) -> list[int]:
    """Lines of `source` that import `prefix` or a module under it (``import x.y``, ``from x.y import``,
    ``from x import y`` where x.y starts with `prefix`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n == prefix or n.startswith(prefix + ".") for n in names):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("line, found", [("import torch.distributed as dist", True),
                                         ("from torch import distributed", True),
                                         ("from torch.distributed import ReduceOp", True),
                                         ("import torch.distributed.elastic", True),
                                         ("import torch", False), ("from torch import nn", False)])
def test_the_import_check_sees_every_form(line, found):
    assert bool(_imports_of(line, "torch.distributed")) is found


def test_only_the_torch_engine_imports_torch_distributed():
    """import-linter sees only top-level external packages, so this rule is an AST check."""
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "engine" / "torchdist.py"
             for n in _imports_of(path.read_text(), "torch.distributed")]
    assert found == [], "only dynamix_hvd/engine/torchdist.py may import torch.distributed; found:\n" + "\n".join(found)


def test_the_horovod_optimizer_module_is_horovods():
    import horovod.torch as hvd
    from dynamix_hvd import engine

    assert hvd.DistributedOptimizer.__module__ == engine.HOROVOD_OPTIMIZER_MODULE


# --- the lab (bench) uses the library's public API only ----------------------------------------------
BENCH = REPO / "bench"
LIBRARY = "dynamix_hvd"


def _private(name: str) -> bool:
    """``_x`` is private; dunders such as ``__version__`` or ``__init__`` are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def library_private_names(package: Path = PACKAGE) -> set[str]:
    """Every underscore name the library defines: functions, classes, module and class attributes,
    and attributes it sets on objects (``self._x = ...``)."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def private_uses(source: str, library_private: set[str], filename: str = "<src>") -> list[str]:
    """Every place in `source` that reaches an underscore name of the library: a private module or
    name imported from dynamix_hvd; an underscore attribute of anything imported from dynamix_hvd
    (``sqnorm._table``, ``dynamix_hvd.stats._x``); and, since objects the library returns cannot be
    followed statically, ``obj._name`` / ``getattr(obj, "_name")`` on any object but ``self``/``cls``
    when the library defines ``_name`` (``controller._decide``, ``opt._flat``), or on ``self`` in a
    subclass of a library class that does not define it itself."""
    tree = ast.parse(source, filename)
    bound: set[str] = set()  # local names of library modules, classes and functions
    found: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == LIBRARY:
                    bound.add(alias.asname or parts[0])
                    if any(_private(p) for p in parts):
                        hit(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == LIBRARY:
            if any(_private(p) for p in node.module.split(".")):
                hit(node, f"from {node.module} import ...")
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(alias.name):
                    hit(node, f"from {node.module} import {alias.name}")

    library_classes: list[ast.ClassDef] = [
        node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
        and any(isinstance(_root(base), ast.Name) and _root(base).id in bound for base in node.bases)]
    inherited: dict[int, set[str]] = {}  # id(self-attribute node) -> the names its class defines itself
    for cls in library_classes:
        own = {n.name for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        own |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}
        own |= {t.id for stmt in cls.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]) if isinstance(t, ast.Name)}
        for n in ast.walk(cls):
            if isinstance(n, ast.Attribute):
                inherited[id(n)] = own

    def reaches(obj: ast.AST, name: str, node: ast.AST) -> bool:
        if not _private(name):
            return False
        root = _root(obj)
        if isinstance(root, ast.Name) and root.id in bound:
            return True
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            return id(node) in inherited and name in library_private and name not in inherited[id(node)]
        return name in library_private

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and reaches(node.value, node.attr, node):
            hit(node, ast.unparse(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and reaches(node.args[0], node.args[1].value, node):
            hit(node, ast.unparse(node))
    return found


@pytest.mark.parametrize("source", [
    "from dynamix_hvd.stats.sqnorm import THREADS, _UNROLL",
    "from dynamix_hvd.stats._kernels import table",
    "import dynamix_hvd.stats._kernels as k",
    "from dynamix_hvd.stats import sqnorm\nsqnorm._table(d, dev)",
    "import dynamix_hvd.stats.sqnorm as s\nx = s._FLOAT_DTYPES",
    "import dynamix_hvd\ndynamix_hvd.stats.sqnorm._table",
    "from dynamix_hvd import DynamixController\nDynamixController._decide",
    "ctl = make()\nctl._decide(1)",  # _decide: a library-defined private name (see the fixture set)
    "self.job.controller._decide()",
    "getattr(ctl, '_decide')",
    "from dynamix_hvd import DynamixController\nclass C(DynamixController):\n    def f(self):\n        return self._decide()",
])
def test_the_private_name_check_sees_every_kind_of_use(source):
    assert private_uses(source, {"_decide", "_table", "_FLOAT_DTYPES"}), source


@pytest.mark.parametrize("source", [
    "from dynamix_hvd.stats.sqnorm import THREADS\nimport dynamix_hvd\nv = dynamix_hvd.__version__",
    "from bench.chaos_system import _mounted, _ours",  # the lab's own private helpers
    "import torch\ntorch._foreach_norm(v, 2)",
    "import sys\nsys._getframe(1)",
    "self._decide()",  # the lab's own class
    "class C(Thread):\n    def f(self):\n        return self._decide()",
    "from dynamix_hvd import DynamixController\nclass C(DynamixController):\n"
    "    def _decide(self):\n        return 1\n    def f(self):\n        return self._decide()",
    "ctl._own_helper()",  # not a name the library defines
])
def test_the_private_name_check_lets_the_lab_own_names_through(source):
    assert private_uses(source, {"_decide", "_table", "_FLOAT_DTYPES"}) == [], source


def test_the_lab_uses_only_public_names_of_the_library():
    library_private = library_private_names()
    assert library_private, "the scan found no underscore name in dynamix_hvd"
    uses = []
    for path in sorted(BENCH.rglob("*.py")):
        uses += private_uses(path.read_text(), library_private, str(path.relative_to(REPO)))
    assert uses == [], ("bench/ uses the library's public API only (give the library a public name, or "
                        "keep the helper in bench); found:\n" + "\n".join(uses))
