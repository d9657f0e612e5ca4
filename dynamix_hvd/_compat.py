"""Import paths from before the subpackages (0.1), kept working for one release.

``import dynamix_hvd.controller`` (or ``from dynamix_hvd.controller import X``) yields the module
that now lives at ``dynamix_hvd.control.controller`` -- the same module object, so classes compare
equal -- with a DeprecationWarning naming the new path. `dynamix_hvd.data` and `dynamix_hvd.dba`
are packages now and serve their old names themselves. The finder answers only for the names in
`MOVED`; every other import is untouched. `python -m` with an old path runs the new module.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "plan": "data.plan", "loader": "data.loader", "metrics": "data.metrics", "resources": "data.resources",
    "optimizer": "optim.weighted", "lr_scaling": "optim.lr_scaling",
    "sqnorm": "stats.sqnorm", "noise_scale": "stats.noise_scale",
    "state": "control.state", "reward": "control.reward", "actions": "control.actions",
    "policy": "control.policy", "baselines": "control.rules", "policy_store": "control.policy_store",
    "controller": "control.controller",
    "ppo": "rl.ppo", "simulator": "rl.simulator", "calibrate": "rl.calibrate", "pretrain": "rl.pretrain",
    "dba_distributed": "dba.distributed",
    "checkpoint": "resilience.checkpoint", "elastic": "resilience.elastic",
    "runlog": "runs.runlog", "report": "runs.report",
    "cli": "tools.cli", "launchcheck": "tools.launchcheck", "buildcheck": "tools.buildcheck",
    "progress": "tools.progress", "policy_tools": "tools.policy_tools",
}
_PACKAGE = __name__.rpartition(".")[0]


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its new name

    def get_code(self, fullname: str):
        # `python -m dynamix_hvd.OLD` (runpy) runs the code of the new module as __main__
        return importlib.util.find_spec(self.target).loader.get_code(self.target)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != _PACKAGE or old not in MOVED:
            return None
        new = f"{_PACKAGE}.{MOVED[old]}"
        warnings.warn(f"{fullname} moved to {new}; the old path will be removed in 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
