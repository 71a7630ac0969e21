"""The embedded default trains and learns; the commands' help reads; probe, push and estimate do what
the README says they do."""

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_megatrain.cli import main


def test_demo_learns(tmp_path, capsys):
    """The demo as `hf-megatrain demo` runs it (its default steps), ending in words reversed right."""
    from hf_megatrain.demo import run_demo

    threads = torch.get_num_threads()
    report = run_demo(str(tmp_path / "demo"), quiet=True)
    assert report["eval_loss_after"] < 0.1 * report["eval_loss_before"]
    assert report["reversed_right"] >= 6, report
    assert (tmp_path / "demo" / "config.json").exists()
    assert torch.get_num_threads() == threads  # the demo's one thread on the CPU is given back
    assert f"{report['reversed_right']}/8 unseen words reversed correctly, after" in capsys.readouterr().out


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


TRAINING_STATE = ["megatrain_optimizer-r00000-00001.safetensors", "megatrain_optimizer.json", "megatrain_manifest.json",
                  "scheduler.pt", "rng_state.pth", "trainer_state.json"]


def test_push_of_a_checkpoint_leaves_the_training_state_out_and_says_so(tmp_path, capsys):
    """A checkpoint's optimizer state (12 bytes per parameter), scheduler, RNG and trainer state stay out of
    the published model, as Trainer's push leaves them out, unless --with_training_state asks for them."""
    from tests.support.tiny import make_model

    ckpt = tmp_path / "out" / "checkpoint-14"
    make_model("llama").save_pretrained(ckpt)
    for name in TRAINING_STATE:
        (ckpt / name).write_bytes(b"x" * 1000)
    hub = tmp_path / "hub"
    assert main(["push", str(ckpt), "--repo", "org/m", "--hub_dir", str(hub)]) == 0
    out = capsys.readouterr().out
    commit = (hub / "models--org--m" / "refs" / "main").read_text().strip()
    published = sorted(os.listdir(hub / "models--org--m" / "snapshots" / commit))
    assert published == ["config.json", "generation_config.json", "model.safetensors"], published
    assert "left out the training state (6 files, 0.0 MiB: optimizer, scheduler, RNG); --with_training_state" in out
    assert main(["push", str(ckpt), "--repo", "org/m", "--hub_dir", str(hub), "--with_training_state"]) == 0
    assert "left out" not in capsys.readouterr().out
    commit = (hub / "models--org--m" / "refs" / "main").read_text().strip()
    assert set(TRAINING_STATE) <= set(os.listdir(hub / "models--org--m" / "snapshots" / commit))


def test_probe_command_measures_the_host_and_caches(tmp_path):
    """On this GPU-less machine: the host's DRAM copy and the engine's own AdamW step, cached."""
    def cli(*args, env=None):
        return subprocess.run([sys.executable, "-m", "hf_megatrain.cli", *args], capture_output=True, text=True,
                              timeout=300, env={**os.environ, **(env or {})})

    r = cli("probe", "--seconds", "1", "--json", env={"HF_MEGATRAIN_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["host_copy_gbs"] > 0 and out["host_update_gbs"] > 0 and out["adamw_gparams"] > 0 and \
        out["adamw_noclip_gparams"] > 0
    assert out["adamw_lean_gparams"] > 0 and out["adamw_lean_noclip_gparams"] > 0
    assert out["cache"] == str(tmp_path / "rates.json")
    cached = json.load(open(tmp_path / "rates.json"))
    assert cached["cpu"]["adamw_gparams"] == out["adamw_gparams"]
    bad = cli("probe", "--seconds", "0")
    assert bad.returncode == 2 and "--seconds must be positive" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine can probe its own GPU")
def test_estimate_on_a_machine_without_a_gpu_does_not_ask_for_a_probe(tmp_path, monkeypatch, capsys):
    """The README's commands as written: after `probe` on a GPU-less machine the step-time line does not
    ask for one again; a bare --lean_resident means true; a CPU run's refusal names no GPU residency."""
    monkeypatch.setenv("HF_MEGATRAIN_CACHE", str(tmp_path))
    assert main(["estimate", "llama-3.1-8b", "--gpu_gib", "80", "--lean_resident"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("step time"))
    assert "no GPU here to probe" in line and "run `hf-megatrain probe`" not in line
    assert "resident on the GPU (lean)" in out
    assert main(["estimate", "llama-3.1-8b", "--device", "cpu", "--host_gib", "16"]) == 1
    verdict = capsys.readouterr().out.split("on 16 GiB host: ")[1]
    assert verdict.startswith("this run does not fit: host RAM") and "gpu_resident_layers" not in verdict


def test_every_subcommand_has_help():
    for cmd in ("estimate", "push"):
        r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and f"usage: hf-megatrain {cmd}" in r.stdout, r.stderr


def test_the_model_card_of_a_cpu_run_says_cpu(tmp_path):
    """`train --push_to_hub` on the CPU: the published model card says where it trained (it said "streamed
    through one GPU" for every run)."""
    from hf_megatrain.demo import build_tokenizer
    from tests.support.tiny import make_model

    make_model("llama").save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": "abcdefg" * 3}) + "\n" for _ in range(8)))
    assert main(["train", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "train.jsonl"),
                 "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--max_seq_length", "16",
                 "--max_steps", "1", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
                 "--push_to_hub", "true", "--hub_dir", str(tmp_path / "hub"), "--hub_model_id", "org/m"]) == 0
    repo = tmp_path / "hub" / "models--org--m"
    card = (repo / "snapshots" / (repo / "refs" / "main").read_text().strip() / "README.md").read_text()
    assert "AdamW state in host RAM, trained on the CPU)" in card and "GPU" not in card, card
