"""The embedded default trains and learns; the command's help reads."""

import subprocess
import sys

from hf_megatrain.cli import main


def test_demo_learns(tmp_path, capsys):
    from hf_megatrain.demo import run_demo

    report = run_demo(str(tmp_path / "demo"), max_steps=300, quiet=True)
    assert report["eval_loss_after"] < 0.5 * report["eval_loss_before"]
    assert report["reversed_right"] >= 6, report
    assert (tmp_path / "demo" / "config.json").exists()


def test_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "train" in out
    for cmd in ("demo", "train"):
        r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert "usage: hf-megatrain " + cmd in r.stdout
    assert main(["nonsense"]) == 2


def test_train_without_data_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--model", str(tmp_path), "--output_dir", str(tmp_path / "o")]) == 2
    assert "no training data" in capsys.readouterr().err
