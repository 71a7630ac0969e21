import atexit
import os
import shutil
import tempfile

import pytest
import torch

from tests.support.warning_guard import deprecations_from_our_calls

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the step-time model's rate cache (hf_megatrain/planner/probe.py): the tests' own, never the user's
os.environ["HF_MEGATRAIN_CACHE"] = tempfile.mkdtemp(prefix="hf_megatrain-cache-")
atexit.register(shutil.rmtree, os.environ["HF_MEGATRAIN_CACHE"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _fail_on_deprecations_from_our_calls():
    """Runs one test phase (setup, call or teardown) and fails it on what warning_guard catches."""
    with deprecations_from_our_calls() as caught:
        result = yield
    if caught:
        pytest.fail("deprecated transformers/accelerate/peft API used inside hf_megatrain:\n" + "\n".join(
            f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _fail_on_deprecations_from_our_calls())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _fail_on_deprecations_from_our_calls())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _fail_on_deprecations_from_our_calls())
