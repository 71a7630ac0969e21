"""What a benchmark record states about the software and the card it ran on.

Every benchmark script puts `versions()` into its JSON record (key "versions"), where it writes
one, and prints `versions_line(versions())` as its first line (prefixed "VERSIONS ") and in its
table header:

    python <X.Y.Z> | torch <version> (CUDA <runtime>) | transformers <version> | accelerate <version> |
    peft <version> | <GPU name>, driver <version> | hf_megatrain <commit> (<where the commit came from>)

(on the device machine, 2026-12-04: python 3.12.3 | torch 2.11.0+cu130 (CUDA 13.0) | transformers
5.17.0 | accelerate 1.15.0 | peft 0.21.0 | NVIDIA H200, driver 580.159.04 | hf_megatrain ...)

The hf_megatrain commit of this checkout is HF_MEGATRAIN_COMMIT when the command sets it (do so on
the device: its copy of the work tree may carry a .git at another commit). Otherwise it comes from
git where the checkout is a git work tree of its own, else from a file named COMMIT in the
checkout's folder (one line, e.g. written beside a `git archive` copy:
`echo 3ecacb0 > .old/COMMIT`). Where none of them says, the record says "commit": null: unknown.
Example: `HF_MEGATRAIN_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/suite.sh A`.

    python benchmarks/versions.py [--json FILE]     # the line; with --json also the record, to FILE
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # this checkout: the one the benchmark scripts put first on sys.path


def _run(cmd: list, timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def package_version(name: str) -> str | None:
    """The version of the module as imported (if it is), else of the distribution that the import
    system would find first; None when it is not installed."""
    v = getattr(sys.modules.get(name), "__version__", None)
    if v:
        return str(v)
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def code_version(folder: str) -> dict:
    """Which hf_megatrain code a folder holds: {"path", "commit", "dirty", "from"}. `dirty` is True
    when tracked files differ from the commit (git only; None where unknown)."""
    out = {"path": folder, "commit": None, "dirty": None, "from": None}
    real = os.path.realpath(folder)
    # Said in the command first: the device machine's copy of the work tree carries a .git that need
    # not be at this commit (once it named the commit before a whole session's changes).
    env = os.environ.get("HF_MEGATRAIN_COMMIT", "").strip()
    if env and real == os.path.realpath(ROOT):
        out.update(commit=env, **{"from": "HF_MEGATRAIN_COMMIT"})
        return out
    top = _run(["git", "-C", real, "rev-parse", "--show-toplevel"])
    # Only the folder's own repository: a copy kept inside another checkout (.old in the repo root)
    # would otherwise report the enclosing checkout's HEAD.
    if top and os.path.realpath(top) == real:
        head = _run(["git", "-C", real, "rev-parse", "--short", "HEAD"])
        if head:
            status = _run(["git", "-C", real, "status", "--porcelain", "--untracked-files=no"])
            out.update(commit=head, dirty=None if status is None else bool(status), **{"from": "git"})
            return out
    try:
        with open(os.path.join(real, "COMMIT")) as f:
            line = f.readline().strip()
        if line:
            out.update(commit=line, **{"from": "COMMIT file"})
            return out
    except OSError:
        pass
    return out


def hf_megatrain_folder() -> str:
    """The checkout whose hf_megatrain this process imports (or would import), without importing it."""
    mod = sys.modules.get("hf_megatrain")
    path = getattr(mod, "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec("hf_megatrain")
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None and spec.origin else None
    return os.path.dirname(os.path.dirname(os.path.abspath(path))) if path else ROOT


def _driver() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"])
    return smi.splitlines()[0].strip() if smi else None


def versions() -> dict:
    """The software and card of this process: Python, torch and the CUDA runtime it was built
    with, transformers, accelerate, peft, the GPU's name and driver (None without a GPU), and the
    hf_megatrain checkout it imports (path and commit)."""
    import torch

    gpu = None
    if torch.cuda.is_available():
        try:
            gpu = torch.cuda.get_device_name()
        except Exception:  # a card that is there but unusable: the record still gets written
            gpu = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": package_version("transformers"),
        "accelerate": package_version("accelerate"),
        "peft": package_version("peft"),
        "gpu": gpu,
        "driver": _driver() if gpu else None,
        "hf_megatrain": code_version(hf_megatrain_folder()),
    }


def describe_code(code: dict) -> str:
    if not code.get("commit"):
        return f"commit unknown ({code.get('path')})"
    how = code["from"] + (", uncommitted changes" if code.get("dirty") else "")
    return f"{code['commit']} ({how})"


def versions_line(v: dict) -> str:
    """One line for a log's first line and a table's header."""
    gpu = "no GPU" if not v.get("gpu") else v["gpu"] + (f", driver {v['driver']}" if v.get("driver") else "")
    cuda = f" (CUDA {v['cuda']})" if v.get("cuda") else " (no CUDA)"
    return (f"python {v['python']} | torch {v['torch']}{cuda} | transformers {v['transformers']} | "
            f"accelerate {v['accelerate']} | peft {v['peft']} | {gpu} | "
            f"hf_megatrain {describe_code(v['hf_megatrain'])}")


def main() -> None:
    sys.path.insert(0, ROOT)  # run as a script: this checkout's hf_megatrain, as the benchmarks import it
    v = versions()
    if len(sys.argv) == 3 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(v, f, indent=1)
    elif len(sys.argv) != 1:
        sys.exit("usage: python benchmarks/versions.py [--json FILE]")
    print("VERSIONS " + versions_line(v), flush=True)


if __name__ == "__main__":
    main()
