"""The examples run on the tiny default, as a user would start them; the SFT and LoRA ones end in
unseen words answered right."""

import os
import re
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.parametrize("script", ["continued_pretraining.py", "lora.py", "trl_sft.py", "dpo.py", "kto.py",
                                    "orpo.py", "dpo.py --dataset_streaming True", "kto.py --dataset_streaming True"])
def test_example_runs_on_the_tiny_default(script, tmp_path):
    """A streamed dataset (TRL's --dataset_streaming): the reference batch by batch, from a copy of the starting
    policy; the same margins."""
    script, *flags = script.split()
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "examples"))
    if script in ("trl_sft.py", "dpo.py", "kto.py", "orpo.py"):
        pytest.importorskip("trl")
        flags += ["--bf16", "False", "--report_to", "none", "--save_strategy", "no"]  # TRL's bf16 default: fp32 on the CPU
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--tiny", "--output_dir", str(out)]
                       + flags, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    if script == "lora.py":
        assert (out / "adapter_config.json").exists() and (out / "merged" / "config.json").exists()
        # the adapters teach the copying base to reverse: it did not before, it does after
        after, before = map(int, re.search(r"(\d)/6 unseen words reversed with the adapters \((\d)/6 by the base",
                                             r.stdout).groups())
        assert after >= 4 and before == 0, r.stdout[-2000:]
        eval_before, eval_after = map(float, r.stdout.split("eval loss: ")[1].split()[0:3:2])
        assert eval_after < 0.25 * eval_before
    else:
        assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    if script in ("dpo.py", "kto.py"):  # the held-out reward margin: 0 at the reference, positive after training
        name = script[:3].upper()
        before, after = map(float, re.search(rf"reward margin: (-?[\d.]+) before {name}, (-?[\d.]+) after",
                                             r.stdout).groups())
        assert abs(before) < 1e-3 and after > 0.5, r.stdout[-2000:]
    if script == "orpo.py":  # no reference: the margin starts where the tiny model puts it, and grows
        before, after, accuracy = map(float, re.search(
            r"reward margin: (-?[\d.]+) before ORPO, (-?[\d.]+) after; reward accuracy after: ([\d.]+)",
            r.stdout).groups())
        assert after > before + 0.05 and accuracy > 0.9, r.stdout[-2000:]


def test_sft_example_runs(tmp_path):
    """Moved from tests/unit/test_data.py: a whole training run in a process of its own."""
    out = tmp_path / "sft"
    r = subprocess.run([sys.executable, "examples/sft.py", "--tiny", "--output_dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model.safetensors").exists() and (out / "chat_template.jinja").exists()
    before, after = r.stdout.split("eval loss: ")[1].split()[0:3:2]
    assert float(after) < 0.25 * float(before)
    right = int(re.search(r"(\d)/6 unseen words answered correctly", r.stdout).group(1))
    assert right >= 4, r.stdout[-2000:]
