"""The examples run on the tiny default, as a user would start them."""

import os
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.parametrize("script", ["continued_pretraining.py", "lora.py", "trl_sft.py"])
def test_example_runs_on_the_tiny_default(script, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "examples"))
    flags = []
    if script == "trl_sft.py":
        pytest.importorskip("trl")
        flags = ["--bf16", "False", "--report_to", "none", "--save_strategy", "no"]  # TRL's bf16 default: fp32 on the CPU
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--tiny", "--output_dir", str(out)]
                       + flags, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    if script == "lora.py":
        assert (out / "adapter_config.json").exists() and (out / "merged" / "config.json").exists()
    else:
        assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def test_sft_example_runs(tmp_path):
    """Moved from tests/unit/test_data.py: a whole training run in a process of its own."""
    out = tmp_path / "sft"
    r = subprocess.run([sys.executable, "examples/sft.py", "--tiny", "--output_dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model.safetensors").exists() and (out / "chat_template.jinja").exists()
    before, after = r.stdout.split("eval loss: ")[1].split()[0:3:2]
    assert float(after) < float(before)
