"""Check that Horovod was built with what dynamix_hvd needs: PyTorch, MPI and Gloo, and for a GPU build
(``--expect-gpu``, what ``launch/setup_env.sh`` asks after an NCCL build) CUDA and NCCL too.

Run as ``python -m dynamix_hvd.tools.buildcheck [--expect-gpu]``; prints what the build has and exits
non-zero naming what is missing.
"""
from __future__ import annotations

import argparse
import sys


def nccl_version_string(code: int) -> str:
    """NCCL_VERSION_CODE (as ``hvd.nccl_built()`` returns it) as 'major.minor.patch'.

    NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch, older 2.x major * 1000 + minor * 100 + patch.
    """
    if code <= 0:
        return "none"
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def horovod_build_info() -> dict[str, object]:
    """What the installed Horovod was built with; raises ImportError when horovod.torch cannot load."""
    import horovod
    import horovod.torch as hvd
    import torch

    return {
        "horovod": horovod.__version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()), "cuda": bool(hvd.cuda_built()),
        "nccl": int(hvd.nccl_built() or 0),
    }


def missing_horovod_features(expect_gpu: bool = False) -> list[str]:
    """Names of required Horovod build features that are absent (empty list when all are present)."""
    try:
        info = horovod_build_info()
    except ImportError as exc:  # horovod missing, or built without the torch extension
        return [f"horovod.torch import ({exc})"]
    checks = {"PyTorch": True, "MPI controller": info["mpi"], "Gloo controller": info["gloo"]}
    if expect_gpu:
        checks["CUDA (torch has CUDA %s)" % info["torch_cuda"] if info["torch_cuda"] else
               "CUDA (this torch has no CUDA)"] = info["cuda"] and bool(info["torch_cuda"])
        checks["NCCL operations"] = info["nccl"] > 0
    return [name for name, ok in checks.items() if not ok]


def describe(info: dict[str, object]) -> str:
    """One line: what the build has."""
    gpu = (f"CUDA yes (torch CUDA {info['torch_cuda']}), NCCL {nccl_version_string(int(info['nccl']))}"
           if info["cuda"] else "CUDA no, NCCL " + ("none" if not info["nccl"] else nccl_version_string(int(info["nccl"]))))
    return (f"horovod {info['horovod']} (torch {info['torch']}): PyTorch, MPI {'yes' if info['mpi'] else 'no'}, "
            f"Gloo {'yes' if info['gloo'] else 'no'}, {gpu}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dynamix_hvd.tools.buildcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--expect-gpu", action="store_true",
                    help="also require CUDA and NCCL (a build made with HOROVOD_GPU_OPERATIONS=NCCL)")
    args = ap.parse_args(argv)
    missing = missing_horovod_features(expect_gpu=args.expect_gpu)
    if missing:
        print("Horovod lacks: " + ", ".join(missing) + ". Rebuild with launch/setup_env.sh "
              "(DYNAMIX_FORCE=1 and delete the cached wheel; docs/install.md: When the build fails).", file=sys.stderr)
        try:
            print(describe(horovod_build_info()), file=sys.stderr)
        except ImportError:
            pass
        return 1
    print(describe(horovod_build_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
