"""pytest plugin that runs TRL's own trainer tests offline, stock or on the engine (`-p plugin`).

* Points the hub at the fixtures of fixtures.py (folder $PEER_FIXTURES, built there if missing or
  stale) through HF_HUB_CACHE / HF_HUB_OFFLINE, set when pytest imports the plugin (before TRL's
  conftest imports huggingface_hub), and `datasets.load_dataset` of the fixture dataset ids at their
  parquet files. Any other hub id stays offline and fails as it would without a network.
* `--peer-engine` swaps the names of the suite (`--peer-suite`, a key of suites.SUITES: sft, the
  default, dpo, kto, orpo or cpo) in its test module for hf_megatrain's classes: `SFTTrainer` /
  `SFTConfig` for `MegaTrainSFTTrainer` / `MegaTrainSFTConfig`, and likewise DPO's, KTO's, ORPO's and
  CPO's; TRL's test file itself is run unmodified.
* The test files are from TRL's newest source, which differs from the installed trl (1.16.0) in places:
  they import names that 1.16.0 does not have (SKEW). Those get placeholders, so the modules import:
  three private helpers of trl.trainer.sft_trainer raise when called (only test classes outside
  TestSFTTrainer call them) and `is_joblib_available` says False (it gates sklearn tests only).
* Skips tests that need vision-language fixtures (none is built offline): those marked
  `@require_vision` themselves (TestSFTTrainer's VLM tests; TestKTOTrainer carries the mark as a
  class, though its tests load text models only, so a class's mark does not count), gives each test a time
  limit (`--peer-timeout`, seconds) and supplies pytest-datadir's `lazy_shared_datadir` when that
  plugin is not installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("PEER_FIXTURES", "/tmp/hf_megatrain_peer/fixtures")).resolve()
os.environ.update({"HF_HUB_CACHE": str(ROOT / "hub"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(ROOT.parent / "hf_home"),
                   "HF_DATASETS_CACHE": str(ROOT.parent / "datasets_cache")})


def _module(name: str):
    """A module of this folder, by file."""
    spec = importlib.util.spec_from_file_location(f"_peer_{name}", HERE / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_addoption(parser):
    group = parser.getgroup("peer", "hf_megatrain peer run of TRL's tests")
    group.addoption("--peer-engine", action="store_true", help="swap in hf_megatrain's trainer and config")
    group.addoption("--peer-suite", default="sft",
                    help="which names to swap: a key of suites.SUITES (sft, dpo, kto, orpo, cpo)")
    group.addoption("--peer-timeout", type=int, default=900, help="seconds per test before it fails (0: none)")


def pytest_configure(config):
    import huggingface_hub.constants as constants

    if not constants.HF_HUB_OFFLINE or Path(constants.HF_HUB_CACHE) != ROOT / "hub":
        raise pytest.UsageError("huggingface_hub was imported before the peer plugin set its environment; "
                                "pass the plugin with -p (run_trl.py does)")
    fixtures = _module("fixtures")
    fixtures.build(ROOT)
    _redirect_load_dataset(fixtures, ROOT)
    _placeholders_for_skew()
    suites = _module("suites").SUITES
    name = config.getoption("--peer-suite")
    if name not in suites:
        raise pytest.UsageError(f"--peer-suite={name!r}: one of {sorted(suites)}")
    config.peer_engine = config.getoption("--peer-engine")
    config.peer_suite = name
    config.peer_swap = suites[name].swap


def _redirect_load_dataset(fixtures, root: Path) -> None:
    import datasets

    real = datasets.load_dataset

    def load_dataset(path, name=None, *args, **kwargs):
        folder = fixtures.dataset_folder(root, path, name) if isinstance(path, str) else None
        if folder is None:
            return real(path, name, *args, **kwargs)
        files = {p.stem: str(p) for p in sorted(folder.glob("*.parquet"))}
        return real("parquet", data_files=files, *args, **kwargs)

    datasets.load_dataset = load_dataset  # test modules import it by name after this point


def pytest_collection_modifyitems(config, items):
    vision = pytest.mark.skip(reason="no offline fixture for vision-language models (peer run)")
    swapped = set()
    for item in items:
        # the test's own marks (its function's, its parameters'), not its class's
        if any(m.name == "skipif" and "requires vision" in str(m.kwargs.get("reason", "")) for m in item.own_markers):
            item.add_marker(vision)
        module = getattr(item, "module", None)
        if config.peer_engine and module is not None and module not in swapped \
                and all(hasattr(module, name) for name in config.peer_swap):
            for name, target in config.peer_swap.items():
                where, attr = target.split(":")
                setattr(module, name, getattr(importlib.import_module(where), attr))
            swapped.add(module)


def pytest_report_header(config):
    names = ", ".join(f"{n} -> {t.replace(':', '.')}" for n, t in config.peer_swap.items())
    side = f"engine ({names})" if config.peer_engine else "stock"
    return f"peer run ({config.peer_suite}): {side}; fixtures {os.environ['HF_HUB_CACHE']}"


SKEW = {"trl.trainer.sft_trainer": ("_chunked_cross_entropy_loss", "_patch_chunked_ce_lm_head", "dft_loss"),
        "trl.import_utils": ("is_joblib_available",)}


def _placeholders_for_skew() -> None:
    import importlib

    import trl

    for module_name, names in SKEW.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                continue
            if name.startswith("is_"):
                setattr(module, name, lambda: False)
                continue

            def missing(*args, _name=f"{module_name}.{name}", **kwargs):
                raise NotImplementedError(f"trl {trl.__version__} has no {_name}")
            setattr(module, name, missing)


class PeerTimeout(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("--peer-timeout")

    def expire(signum, frame):
        raise PeerTimeout(f"test ran past --peer-timeout={limit}s")

    previous = signal.signal(signal.SIGALRM, expire) if limit else None
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        if limit:
            signal.signal(signal.SIGALRM, previous)


try:
    import pytest_datadir  # noqa: F401  (it supplies the fixture itself)
except ImportError:
    @pytest.fixture
    def lazy_shared_datadir(request, tmp_path):
        """pytest-datadir's fixture: a copy of the `data` folder beside the test module."""
        source = Path(request.fspath).parent / "data"
        target = tmp_path / "data"
        shutil.copytree(source, target)
        return target
