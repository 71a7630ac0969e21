"""Run one of TRL's trainer test suites stock and on the engine, offline, and compare.

    python peer_tests/run_trl.py /path/to/trl-checkout [--suite sft|dpo|kto|orpo|cpo] [--only stock|engine]
                                 [-k EXPR] [--out DIR] [--fixtures DIR]

The suites (suites.py): sft, `tests/test_sft_trainer.py::TestSFTTrainer` (the default); dpo,
`tests/test_dpo_trainer.py::TestDPOTrainer`; kto, `tests/test_kto_trainer.py::TestKTOTrainer`; orpo,
`tests/experimental/test_orpo_trainer.py::TestORPOTrainer`; cpo,
`tests/experimental/test_cpo_trainer.py::TestCPOTrainer`. The engine side swaps the suite's trainer and
config for hf_megatrain's.

Only the checkout's `tests/` (and its pytest settings in pyproject.toml) are used, copied to
OUT/suite so that `trl` is the installed package, not the checkout's source. Each side writes
OUT/<side>/junit.xml and OUT/<side>/log.txt; the last lines printed are the counts of both sides and
the tests whose outcome differs (the reason of each engine failure on one line).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIDES = ("stock", "engine")
PEER = Path("/tmp/hf_megatrain_peer")


def load(name: str):
    """A module of this folder, by file (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_peer_{name}", HERE / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage_suite(checkout: Path, out: Path) -> Path:
    suite = out / "suite"
    shutil.rmtree(suite, ignore_errors=True)
    shutil.copytree(checkout / "tests", suite / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    if (checkout / "pyproject.toml").is_file():
        shutil.copy(checkout / "pyproject.toml", suite / "pyproject.toml")
    return suite


def versions(checkout: Path) -> str:
    """What a result depends on: the test source, the installed trl and hf_megatrain's commit."""
    import trl

    def git(*cmd, cwd=HERE):
        done = subprocess.run(["git", *cmd], cwd=cwd, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    tests = (checkout / "VERSION").read_text().strip() if (checkout / "VERSION").is_file() else "?"
    if (checkout / ".git").exists():
        tests += " " + git("rev-parse", "--short", "HEAD", cwd=checkout)
    elif (checkout / "COMMIT").is_file():  # an archive made as README.md says
        tests += " " + (checkout / "COMMIT").read_text().strip()[:9]
    dirty = " + uncommitted changes in hf_megatrain/" if git("status", "--porcelain", "--", "../hf_megatrain") else ""
    return f"TRL tests {tests} ({checkout}); trl {trl.__version__} installed; hf_megatrain {git('rev-parse', '--short', 'HEAD')}{dirty}"


def run_side(side: str, suite: Path, out: Path, fixtures: Path, args) -> float:
    folder = out / side
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "versions.txt").write_text(versions(args.checkout.resolve()) + "\n")
    cmd = [sys.executable, "-m", "pytest", *args.suite_spec.targets(), "-p", "plugin", "-p", "no:cacheprovider",
           "-q", "-rfE", f"--junitxml={folder / 'junit.xml'}", f"--peer-timeout={args.test_timeout}",
           f"--peer-suite={args.suite}"]
    cmd += ["--peer-engine"] if side == "engine" else []
    cmd += ["-k", args.k] if args.k else []
    env = dict(os.environ, PYTHONPATH=str(HERE), PEER_FIXTURES=str(fixtures), TOKENIZERS_PARALLELISM="false")
    print(f"[{side}] {' '.join(cmd)}\n[{side}] log: {folder / 'log.txt'}", flush=True)
    start = time.time()
    with open(folder / "log.txt", "w") as log:
        subprocess.run(cmd, cwd=suite, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.time() - start
    (folder / "seconds").write_text(f"{seconds:.0f}")
    return seconds


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test name -> (passed | failed | error | skipped, first line of the message)."""
    result = {}
    for case in ET.parse(junit).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                text = child.get("message") or child.text or ""
                message = next((line.strip() for line in text.splitlines() if line.strip()), "")
                break
        result[case.get("name")] = (outcome, message)
    return result


def summary(out: Path, suite) -> None:
    results = {s: outcomes(out / s / "junit.xml") for s in SIDES if (out / s / "junit.xml").is_file()}
    print(f"\n== TRL {', '.join(suite.targets())}, stock vs engine ==")
    for side, res in results.items():
        counts = {k: sum(o == k for o, _ in res.values()) for k in ("passed", "failed", "error", "skipped")}
        seconds = (out / side / "seconds").read_text() if (out / side / "seconds").is_file() else "?"
        print(f"{side:>6}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f"  ({seconds}s)")
        if (out / side / "versions.txt").is_file():
            print(f"        {(out / side / 'versions.txt').read_text().strip()}")
    if len(results) < 2:
        return
    stock, engine = results["stock"], results["engine"]
    differ = sorted(n for n in stock.keys() | engine.keys()
                    if stock.get(n, ("-",))[0] != engine.get(n, ("-",))[0])
    if differ:
        width = max(len(n) for n in differ)
        print(f"\n{'test':<{width}}  {'stock':<7}  {'engine':<7}")
        for n in differ:
            print(f"{n:<{width}}  {stock.get(n, ('-',))[0]:<7}  {engine.get(n, ('-',))[0]:<7}")
    broken = [n for n in differ if stock.get(n, ("",))[0] == "passed" and engine.get(n, ("",))[0] in ("failed", "error")]
    print(f"\npass stock, fail engine: {len(broken)}")
    for n in broken:
        print(f"  {n}: {engine[n][1][:220]}")


def main() -> None:
    suites = load("suites")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a TRL source checkout (its tests/ folder is used)")
    parser.add_argument("--suite", choices=sorted(suites.SUITES), default="sft", help="which TRL tests (suites.py)")
    parser.add_argument("--only", choices=SIDES, help="run one side (the summary still reads the other's last run)")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--out", type=Path, help="junit/log folder (default: /tmp/hf_megatrain_peer/run for sft, "
                        "run_<suite> for the others)")
    parser.add_argument("--fixtures", type=Path, default=PEER / "fixtures",
                        help="the offline hub and datasets (built there if missing or stale; shared by the suites)")
    parser.add_argument("--test-timeout", type=int, default=900, help="seconds per test")
    args = parser.parse_args()
    args.suite_spec = suites.SUITES[args.suite]
    args.out = args.out or PEER / ("run" if args.suite == "sft" else f"run_{args.suite}")
    if not (args.checkout / args.suite_spec.path).is_file():
        parser.error(f"{args.checkout} has no {args.suite_spec.path}")
    fixtures = load("fixtures")
    start = time.time()
    fixtures.build(args.fixtures)
    print(f"fixtures: {args.fixtures} ({time.time() - start:.0f}s)")
    suite = stage_suite(args.checkout.resolve(), args.out)
    for side in [args.only] if args.only else SIDES:
        run_side(side, suite, args.out, args.fixtures.resolve(), args)
    summary(args.out, args.suite_spec)


if __name__ == "__main__":
    main()
