"""Check that Horovod was built with what dynamix_hvd needs: PyTorch, MPI and Gloo.

Run as ``python -m dynamix_hvd.tools.buildcheck``; exits non-zero naming what is missing.
"""
from __future__ import annotations

import sys


def missing_horovod_features() -> list[str]:
    """Names of required Horovod build features that are absent (empty list when all are present)."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:  # horovod missing, or built without the torch extension
        return [f"horovod.torch import ({exc})"]
    checks = {
        "PyTorch": True,
        "MPI controller": hvd.mpi_built(),
        "Gloo controller": hvd.gloo_built(),
    }
    return [name for name, ok in checks.items() if not ok]


def main() -> int:
    missing = missing_horovod_features()
    if missing:
        print("Horovod lacks: " + ", ".join(missing) + ". Rebuild with launch/setup_env.sh "
              "(DYNAMIX_FORCE=1 and delete the cached wheel).", file=sys.stderr)
        return 1
    import horovod

    print(f"horovod {horovod.__version__}: PyTorch, MPI and Gloo available")
    return 0


if __name__ == "__main__":
    sys.exit(main())
