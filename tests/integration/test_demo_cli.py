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


def test_push_command_publishes_a_saved_folder(tmp_path, capsys):
    from tests.support.tiny import make_model

    make_model("llama").save_pretrained(tmp_path / "m")
    assert main(["push", str(tmp_path / "m"), "--repo", "org/m", "--hub_dir", str(tmp_path / "hub")]) == 0
    commit = (tmp_path / "hub" / "models--org--m" / "refs" / "main").read_text().strip()
    assert commit in capsys.readouterr().out
    assert (tmp_path / "hub" / "models--org--m" / "snapshots" / commit / "model.safetensors").is_symlink()
    assert main(["push", str(tmp_path), "--repo", "org/x", "--hub_dir", str(tmp_path / "hub")]) == 2


def test_every_subcommand_has_help():
    for cmd in ("estimate", "push"):
        r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and f"usage: hf-megatrain {cmd}" in r.stdout, r.stderr
