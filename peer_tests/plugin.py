"""pytest plugin that runs TRL's own SFT tests offline, stock or on the engine (`-p plugin`).

* Points the hub at the fixtures of fixtures.py (folder $PEER_FIXTURES, built there if missing or
  stale) through HF_HUB_CACHE / HF_HUB_OFFLINE, set when pytest imports the plugin (before TRL's
  conftest imports huggingface_hub), and `datasets.load_dataset` of the fixture dataset ids at their
  parquet files. Any other hub id stays offline and fails as it would without a network.
* `--peer-engine` swaps `SFTTrainer` / `SFTConfig` in the test modules for hf_megatrain's
  `MegaTrainSFTTrainer` / `MegaTrainSFTConfig`; TRL's test file itself is run unmodified.
* The test files are from TRL's newest source, which differs from the installed trl (1.16.0) in places:
  they import names that 1.16.0 does not have (SKEW). Those get placeholders, so the modules import:
  three private helpers of trl.trainer.sft_trainer raise when called (only test classes outside
  TestSFTTrainer call them) and `is_joblib_available` says False (it gates sklearn tests only).
* Skips tests that need vision-language fixtures (none is built offline), gives each test a time
  limit (`--peer-timeout`, seconds) and supplies pytest-datadir's `lazy_shared_datadir` when that
  plugin is not installed.
"""

from __future__ import annotations

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


def _fixtures_module():
    spec = importlib.util.spec_from_file_location("_peer_fixtures", HERE / "fixtures.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_addoption(parser):
    group = parser.getgroup("peer", "hf_megatrain peer run of TRL's tests")
    group.addoption("--peer-engine", action="store_true", help="swap in MegaTrainSFTTrainer / MegaTrainSFTConfig")
    group.addoption("--peer-timeout", type=int, default=900, help="seconds per test before it fails (0: none)")


def pytest_configure(config):
    import huggingface_hub.constants as constants

    if not constants.HF_HUB_OFFLINE or Path(constants.HF_HUB_CACHE) != ROOT / "hub":
        raise pytest.UsageError("huggingface_hub was imported before the peer plugin set its environment; "
                                "pass the plugin with -p (run_trl_sft.py does)")
    fixtures = _fixtures_module()
    fixtures.build(ROOT)
    _redirect_load_dataset(fixtures, ROOT)
    _placeholders_for_skew()
    config.peer_engine = config.getoption("--peer-engine")


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
        if any(m.name == "skipif" and "requires vision" in str(m.kwargs.get("reason", "")) for m in item.iter_markers()):
            item.add_marker(vision)
        module = getattr(item, "module", None)
        if config.peer_engine and module is not None and module not in swapped and hasattr(module, "SFTTrainer"):
            from hf_megatrain.sft import MegaTrainSFTConfig, MegaTrainSFTTrainer

            module.SFTTrainer, module.SFTConfig = MegaTrainSFTTrainer, MegaTrainSFTConfig
            swapped.add(module)


def pytest_report_header(config):
    side = "engine (hf_megatrain.sft.MegaTrainSFTTrainer / MegaTrainSFTConfig)" if config.peer_engine else "stock"
    return f"peer run: {side}; fixtures {os.environ['HF_HUB_CACHE']}"


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
