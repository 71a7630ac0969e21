"""Prints the versions a test run uses: `python .ci/stack.py LABEL`."""

import sys
from importlib.metadata import PackageNotFoundError, version


def found(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


names = ("torch", "transformers", "accelerate", "peft", "datasets", "huggingface_hub", "trl")
print(f"== {' '.join(sys.argv[1:])}: python {sys.version.split()[0]}, "
      + ", ".join(f"{n} {found(n)}" for n in names), flush=True)
