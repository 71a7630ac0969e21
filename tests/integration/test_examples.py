"""The examples run on the tiny default, as a user would start them."""

import os
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.parametrize("script", ["continued_pretraining.py", "lora.py"])
def test_example_runs_on_the_tiny_default(script, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "examples"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--tiny", "--output_dir", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    if script == "lora.py":
        assert (out / "adapter_config.json").exists() and (out / "merged" / "config.json").exists()
    else:
        assert (out / "config.json").exists() and (out / "model.safetensors").exists()
