"""Peer test: transformers' own tests/trainer files, run stock and with MegaTrainTrainer swapped in.

    python peer_tests/run_transformers_trainer.py /tmp/transformers-v5.15.0 \
        [--only stock|engine] [-k EXPR] [--files test_trainer.py,...] [--out DIR] [--timeout S]

CHECKOUT is a (partial) transformers checkout at tag v5.15.0 holding at least conftest.py,
pyproject.toml, tests/__init__.py, tests/fixtures and tests/trainer, and no src/ (the installed
transformers is what runs). From any clone that has the tag:

    mkdir -p /tmp/transformers-v5.15.0 && git -C CLONE archive v5.15.0 conftest.py pyproject.toml \
        tests/__init__.py tests/trainer tests/fixtures | tar x -C /tmp/transformers-v5.15.0

The test files also need `pip install parameterized`. Both runs are CPU only and offline
(transformers_plugin.py serves tiny local stand-ins for the hub ids the decoder-LM tests load).
Outputs go under --out (default /tmp/peer_transformers): <side>.xml (junit), <side>.log,
<side>.jsonl (one line per test, written by the plugin). The last thing printed is the table:
counts per side, then every test that passes stock but not on the engine, with its reason.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("stock", "engine")
OUTCOMES = ("passed", "failed", "skipped", "error")


def run_side(side: str, checkout: str, files: list[str], args) -> float:
    out = args.out
    env = dict(os.environ, PEER_TF_MODE=side, PEER_TF_RESULTS=os.path.join(out, f"{side}.jsonl"),
               PEER_TF_FIXTURES=os.path.join(out, "fixtures"), PEER_TF_TIMEOUT=str(args.timeout),
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_CACHE=os.path.join(out, "fixtures", "hub"), HF_DATASETS_CACHE=os.path.join(out, "datasets"),
               CUDA_VISIBLE_DEVICES="", WANDB_DISABLED="true", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "pytest", "-p", "transformers_plugin", "-p", "no:cacheprovider",
           "--rootdir", checkout, "-c", os.path.join(checkout, "pyproject.toml"),
           f"--junitxml={os.path.join(out, side + '.xml')}", "-q", "-rfEs", *files]
    if args.k:
        cmd += ["-k", args.k]
    scratch = os.path.join(out, "cwd-" + side)  # tests that write to a relative path write here
    os.makedirs(scratch, exist_ok=True)
    start = time.time()
    with open(os.path.join(out, side + ".log"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT)
    took = time.time() - start
    print(f"{side}: pytest exit {proc.returncode} in {took / 60:.1f} min (log {os.path.join(out, side + '.log')})",
          flush=True)
    return took


def load(out: str, side: str) -> dict[str, dict] | None:
    path = os.path.join(out, f"{side}.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return {r["nodeid"]: r for r in map(json.loads, f) if r}


def kind_of(nodeid: str, results: list[dict]) -> str:
    """decoder-LM: some Trainer in the test got a causal LM; toy: only toy modules or non-LM heads."""
    kinds = set()
    for res in results:
        kinds |= set(res.get(nodeid, {}).get("kinds", ()))
    if kinds & {"causal-lm", "hub-id"}:
        return "decoder-LM"
    return "toy/other model" if kinds - {"none"} else "no Trainer model"


def counts_line(label: str, rows: list[dict], minutes: str = "") -> str:
    count = [sum(r["outcome"] == o for r in rows) for o in (*OUTCOMES, "xfailed")]
    return f"{label:22}" + "".join(f"{c:>9}" for c in count) + f"{len(rows):>7}  {minutes}"


def engine_line(e: dict) -> str:
    """The engine's one-line reason: a MegaTrainError is a refusal (flagged when its message is
    longer than one line); anything else says where it was raised."""
    if e.get("exc_type", "").endswith("MegaTrainError"):
        lines = e.get("message_lines", 1)
        return "refusal" + ("" if lines == 1 else f" ({lines} lines)") + ": " + e["reason"].split(": ", 1)[-1]
    where = e.get("hf_megatrain_frame") or e.get("raised_at")
    return f"{e['outcome']}: {e.get('reason', '')}" + (f"  [at {where}]" if where else "")


def report(out: str, side_seconds: dict[str, float]) -> None:
    results = {side: load(out, side) for side in SIDES}
    print("\n" + "=" * 100)
    try:
        head = subprocess.run(["git", "-C", HERE, "log", "-1", "--format=%h %s"], capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../hf_megatrain"],
                               capture_output=True, text=True).stdout
        print(f"hf_megatrain at {head.strip()[:80]}" + (" (+ uncommitted changes in hf_megatrain/)" if dirty else ""))
    except OSError:
        pass
    print(f"{'side / tests':22}" + "".join(f"{o:>9}" for o in (*OUTCOMES, "xfailed")) + f"{'total':>7}  minutes")
    both = [r for r in results.values() if r is not None]
    for side, res in results.items():
        if res is None:
            print(f"{side:22}(no results in {out})")
            continue
        took = f"{side_seconds[side] / 60:.1f}" if side in side_seconds else "(earlier run)"
        print(counts_line(f"{side} all", list(res.values()), took))
    for side, res in results.items():
        if res is not None:
            print(counts_line(f"{side} decoder-LM", [r for n, r in res.items() if kind_of(n, both) == "decoder-LM"]))
    stock, engine = results["stock"], results["engine"]
    unswapped = sorted(n for n, r in (engine or {}).items() if r.get("unswapped"))
    if unswapped:  # e.g. Seq2SeqTrainer: a Trainer subclass of transformers' own, which the swap cannot reach
        print(f"\nengine side: {len(unswapped)} tests built a stock Trainer subclass: "
              + ", ".join(f"{n.rsplit('/', 1)[-1]} ({','.join(engine[n]['unswapped'])})" for n in unswapped))
    if stock is None or engine is None:
        return
    lost = [n for n, r in stock.items() if r["outcome"] == "passed" and n in engine and engine[n]["outcome"] != "passed"]
    print(f"\npassed stock, not on the engine: {len(lost)} (grouped by the engine's reason)")
    for group in ("decoder-LM", "toy/other model", "no Trainer model"):
        nodes = sorted(n for n in lost if kind_of(n, both) == group)
        print(f"\n  {group} tests: {len(nodes)}")
        by_reason: dict[str, list[str]] = {}
        for n in nodes:
            by_reason.setdefault(engine_line(engine[n]), []).append(n.rsplit("/", 1)[-1])
        for reason, tests in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            print(f"    [{len(tests)}] {reason if len(reason) < 240 else reason[:237] + '...'}")
            for t in tests:
                print(f"          {t}")
    gained = [n for n, r in engine.items() if r["outcome"] == "passed" and n in stock and stock[n]["outcome"] != "passed"]
    if gained:
        print(f"\npassed on the engine, not stock: {len(gained)}: " + ", ".join(n.rsplit("/", 1)[-1] for n in gained))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", help="transformers checkout (tag v5.15.0) with tests/trainer")
    parser.add_argument("--only", choices=SIDES, help="run one side (the table still uses the other's last results)")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--files", help="comma-separated file names in tests/trainer (default: every test_*.py there)")
    parser.add_argument("--out", default="/tmp/peer_transformers", help="outputs (default %(default)s)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test (default %(default)s)")
    args = parser.parse_args()

    checkout = os.path.abspath(args.checkout)
    trainer_dir = os.path.join(checkout, "tests", "trainer")
    if not os.path.isdir(trainer_dir):
        sys.exit(f"{trainer_dir} does not exist: CHECKOUT must hold transformers' tests/trainer (see --help)")
    if os.path.isdir(os.path.join(checkout, "src", "transformers")):
        sys.exit(f"{checkout}/src/transformers exists: its conftest would import that copy, not the installed one")
    if args.files:
        files = [os.path.join(trainer_dir, f.strip()) for f in args.files.split(",") if f.strip()]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            sys.exit("no such test file: " + ", ".join(missing))
    else:
        files = sorted(glob.glob(os.path.join(trainer_dir, "test_*.py")))
    os.makedirs(args.out, exist_ok=True)
    seconds = {}
    for side in ([args.only] if args.only else SIDES):
        seconds[side] = run_side(side, checkout, files, args)
    report(args.out, seconds)


if __name__ == "__main__":
    main()
