"""The command line as a user types it: each trap a user met (issues 19 and 32) through the real
command, in a process of its own, on a tiny local model folder and a JSONL file. A mistake is one
line on stderr, exit status 2, before any weight is read."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from hf_megatrain.demo import build_tokenizer
from tests.support import ROOT
from tests.support.tiny import make_model

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny Llama folder with a tokenizer, and a JSONL file of short texts."""
    root = tmp_path_factory.mktemp("cli")
    make_model("llama").save_pretrained(root / "model")
    build_tokenizer().save_pretrained(root / "model")
    rows = [{"text": "abcdefghij"[i % 7:] + "xyz" * (i % 4)} for i in range(40)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def train(cwd, *flags, timeout=300):
    return subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "train", *map(str, flags)],
                          capture_output=True, text=True, env=_env(), cwd=cwd, timeout=timeout)


# The command with a loader that fails loudly if any weight is read, and without the modules named in
# HIDE (as if they were not installed: find_spec says None for a module set to None in sys.modules).
NO_WEIGHTS = (
    "import os, sys\n"
    "for name in filter(None, os.environ.get('HIDE', '').split(',')): sys.modules[name] = None\n"
    "import hf_megatrain.checkpoint.stream_load as s, hf_megatrain.cli as cli\n"
    "def read(*a, **k): raise SystemExit('weights were read')\n"
    "s.load_into_store = read\n"
    "sys.exit(cli.main(sys.argv[1:]))\n"
)


def refused(cwd, *args, prefix=(), hide=(), env=None) -> str:
    """The one line that `hf-megatrain ARGS` prints before it exits with status 2, no weight read."""
    r = subprocess.run([*prefix, sys.executable, "-c", NO_WEIGHTS, *map(str, args)], capture_output=True, text=True,
                       env={**(env or _env()), "HIDE": ",".join(hide)}, cwd=cwd, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert "weights were read" not in r.stderr and "Traceback" not in r.stderr
    return lines[0]


def test_a_mistyped_flag_is_one_line_naming_the_flag_meant(run_dir, tmp_path):
    line = refused(tmp_path, "train", *common(run_dir, tmp_path / "out"), "--leraning_rate", "1e-3")
    assert line == ("hf-megatrain train: error: no flag --leraning_rate; did you mean --learning_rate? "
                    "(`hf-megatrain train --help-all` lists every flag)")
    line = refused(tmp_path, "train", *common(run_dir, tmp_path / "out"), "--learning_rate", "fast")
    assert line == "hf-megatrain train: error: argument --learning_rate/--learning-rate: invalid float value: 'fast'"


@pytest.mark.parametrize("flags, says", [
    (["--learning_rate=-1e-3"], "learning_rate=-0.001 is negative; AdamW takes learning_rate >= 0."),
    (["--adam_beta2", "1", "--max_grad_norm", "-1"], "adam_beta2=1 is outside [0, 1), where AdamW's betas must be; "
     "max_grad_norm=-1 is negative; give a positive norm to clip to, or 0 for no clipping."),
    (["--eval_strategy", "steps"], "eval_strategy='steps' evaluates, but there is no evaluation data: pass "
     "--eval_data FILE_OR_DATASET, or --eval_strategy no."),
    (["--report_to", "tensorbord"], "report_to='tensorbord' is not a logger Trainer knows; choose from"),
], ids=["learning_rate", "betas_and_clipping", "eval_without_data", "unknown_logger"])
def test_a_value_the_run_would_refuse_later_is_refused_before_the_weights(run_dir, tmp_path, flags, says):
    """The arguments are built, and checked as the optimizer and Trainer would check them, before the model."""
    line = refused(tmp_path, "train", *common(run_dir, tmp_path / "out"), *flags)
    assert line.startswith(f"hf-megatrain train: error: {says}"), line


def test_report_to_a_logger_that_is_not_installed_names_its_package(run_dir, tmp_path):
    line = refused(tmp_path, "train", *common(run_dir, tmp_path / "out"), "--report_to", "tensorboard",
                   hide=("tensorboard", "tensorboardX"))
    assert line == ("hf-megatrain train: error: report_to='tensorboard' needs the 'tensorboard' package, which is "
                    "not installed: `pip install tensorboard`, or choose another logger (--report_to none).")


@pytest.mark.parametrize("content, says", [
    ("", "empty.jsonl is empty: it holds no rows to train on. Point the data at a file with rows."),
    ('{"text": "abc"}\n{"text": "abd"}\n{"text": "abe",}\n', "could not read empty.jsonl line 3: not valid JSON (Expecting property "
     "name enclosed in double quotes, column 16); fix or remove that line"),
    ('{"text": "abc"}\n{"text": 5}\n', "data_path='empty.jsonl', checked on its first 2 rows: row 1: 'text' holds int "
     "5, where it must be a string"),
], ids=["empty", "bad_json_line", "not_a_string"])
def test_a_data_file_that_cannot_train_is_one_line(run_dir, tmp_path, content, says):
    (tmp_path / "empty.jsonl").write_text(content)
    flags = common(run_dir, tmp_path / "out")
    flags[flags.index("--data") + 1] = "empty.jsonl"
    line = refused(tmp_path, "train", *flags)
    assert line.startswith(f"hf-megatrain train: error: {says}"), line


def _online_env():
    """The command as a user without HF_HUB_OFFLINE runs it: a lookup on the hub would retry for ~25 s."""
    return {k: v for k, v in _env().items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}


def test_cli_missing_data_one_line_no_network(run_dir, tmp_path):
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "train", "--model", run_dir / "model",
                        "--data", "missing.jsonl", "--output_dir", str(tmp_path / "out"), "--use_cpu"],
                       capture_output=True, text=True, env=_online_env(), cwd=tmp_path, timeout=300)
    elapsed = time.perf_counter() - start
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"hf-megatrain train: error: data path 'missing.jsonl' does not exist; check the path (relative paths "
        f"start from {tmp_path}).")
    assert "loading weights" not in r.stderr and "huggingface.co" not in r.stderr
    assert elapsed < 30, elapsed  # imports take ~10 s; the hub's retries alone would add ~25 s


def test_read_only_output_dir_through_the_cli(run_dir, tmp_path):
    """chmod 555, and for root a process without CAP_DAC_OVERRIDE, so that the mode binds it too."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root needs setpriv to drop CAP_DAC_OVERRIDE")
        prefix = ["setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override"]
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        line = refused(tmp_path, "train", "--model", run_dir / "model", "--data", run_dir / "train.jsonl",
                       "--output_dir", locked / "out", "--use_cpu", "--report_to", "none", prefix=prefix,
                       env=_online_env())
    finally:
        locked.chmod(0o755)
    assert line == (
        f"hf-megatrain train: error: output_dir={str(locked / 'out')!r} is not writable (no write permission on "
        f"{locked}); choose another output_dir or change its permissions.")
    assert not os.listdir(locked)


def common(root, out):
    return ["--model", root / "model", "--data", root / "train.jsonl", "--output_dir", out, "--use_cpu", "true",
            "--max_seq_length", "16", "--per_device_train_batch_size", "2", "--report_to", "none",
            "--save_strategy", "no", "--disable_tqdm", "true"]


def steps_run(checkpoint) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


@pytest.mark.parametrize("how", ["inline", "file"])
def test_peft_config_takes_inline_json_or_a_file(run_dir, tmp_path, how):
    (tmp_path / "lora.json").write_text(json.dumps(LORA))
    value = json.dumps(LORA) if how == "inline" else "lora.json"  # a relative path, from the working folder
    out = tmp_path / "out"
    r = train(tmp_path, *common(run_dir, out), "--max_steps", "1", "--peft_config", value)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["r"] == 4 and sorted(saved["target_modules"]) == ["q_proj", "v_proj"]


@pytest.mark.parametrize("method", [
    {"peft_type": "IA3", "target_modules": ["q_proj", "down_proj"], "feedforward_modules": ["down_proj"]},
    {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 3},
], ids=["ia3", "prefix_tuning"])
def test_peft_config_with_a_peft_type_trains_that_method(run_dir, tmp_path, method):
    """`--peft_config` with a peft_type trains that PEFT method; the adapter it saves loads back with
    PeftModel.from_pretrained, and its adapter_config.json given back as --peft_config (inference_mode true, as PEFT
    saves it) is refused in one line: its adapters would be frozen."""
    from peft import PeftModel

    out = tmp_path / "out"
    r = train(tmp_path, *common(run_dir, out), "--max_steps", "2", "--learning_rate", "1e-2",
              "--peft_config", json.dumps(method))
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["peft_type"] == method["peft_type"] and saved["inference_mode"] is True
    back = PeftModel.from_pretrained(make_model("llama"), str(out))
    assert back.peft_config["default"].peft_type.value == method["peft_type"]
    line = refused(tmp_path, "train", *common(run_dir, tmp_path / "again"), "--max_steps", "1",
                   "--peft_config", out / "adapter_config.json")
    assert "inference_mode=true" in line, line


def test_peft_config_that_is_not_json_is_one_clear_line(run_dir, tmp_path):
    r = train(tmp_path, *common(run_dir, tmp_path / "out"), "--max_steps", "1", "--peft_config", "{r: 8")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "cannot be read as inline JSON" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("spelling", ["positional", "--config"])
def test_flags_after_a_config_file_override_it(run_dir, tmp_path, spelling):
    flags = common(run_dir, tmp_path / "out")
    config = {flags[i].lstrip("-"): str(flags[i + 1]) for i in range(0, len(flags), 2)}
    config.update(max_steps=5, save_strategy="steps", save_steps=1, save_total_limit=1)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    where = ["run.yaml"] if spelling == "positional" else ["--config", "run.yaml"]
    r = train(tmp_path, *where, "--max_steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_run(tmp_path / "out" / "checkpoint-2") == 2  # the YAML said 5; the flag won
    assert not (tmp_path / "out" / "checkpoint-5").exists()


def test_a_config_key_that_is_no_flag_is_refused(run_dir, tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"model": "m", "max_stepz": 3}))
    r = train(tmp_path, "run.yaml")
    assert r.returncode == 2 and "unknown keys ['max_stepz']" in r.stderr, r.stderr[-2000:]


def test_resume_from_checkpoint_true_means_the_last_checkpoint(run_dir, tmp_path):
    out = tmp_path / "out"
    flags = common(run_dir, out)
    flags[flags.index("--save_strategy") + 1] = "steps"
    first = train(tmp_path, *flags, "--max_steps", "2", "--save_steps", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert steps_run(out / "checkpoint-2") == 2
    again = train(tmp_path, *flags, "--max_steps", "3", "--save_steps", "3", "--resume_from_checkpoint", "True",
                  "--log_level", "info")
    assert again.returncode == 0, again.stderr[-2000:]
    assert steps_run(out / "checkpoint-3") == 3
    assert "Resuming training from checkpoint with epoch 0 and global step 2" in again.stderr  # not anew


def test_train_help_is_short_and_fast_and_help_all_has_every_flag():
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "train", "--help"], capture_output=True,
                       text=True, env=_env(), timeout=60)
    elapsed = time.perf_counter() - start
    assert r.returncode == 0 and r.stdout.startswith("usage: hf-megatrain train")
    assert len(r.stdout.splitlines()) < 60 and elapsed < 2.0, (len(r.stdout.splitlines()), elapsed)
    full = subprocess.run([sys.executable, "-m", "hf_megatrain.cli", "train", "--help-all"], capture_output=True,
                          text=True, env=_env(), timeout=120)
    assert full.returncode == 0 and "--lr_scheduler_kwargs" in full.stdout and "--lean_resident" in full.stdout


def test_the_short_help_names_real_flags_and_all_of_ours():
    """The short help is written by hand (it must open without importing transformers): every flag it
    names exists, and every field hf_megatrain adds to TrainingArguments is in it."""
    import re
    from dataclasses import fields

    from transformers import TrainingArguments

    from hf_megatrain.arguments import MegaTrainArguments
    from hf_megatrain.cli import TRAIN_HELP, _train_parser

    flags = {o for a in _train_parser()._actions for o in a.option_strings}
    named = set(re.findall(r"(--[a-z_]+)", TRAIN_HELP)) - {"--help-all", "--config"}
    assert named <= flags, named - flags
    ours = {f.name for f in fields(MegaTrainArguments)} - {f.name for f in fields(TrainingArguments)}
    ours -= {"background_host_jobs"}  # a testing switch, in --help-all only
    shown = {n.lstrip("-") for n in named} | {"data_path", "eval_data_path"}  # as --data / --eval_data
    assert ours <= shown, ours - shown


def test_transient_grads_with_clipping_from_the_command_line_saves_what_the_default_saves(run_dir, tmp_path):
    """`hf-megatrain train --transient_grads true` with the default clipping (max_grad_norm 1.0, here
    0.01 so that it acts): each step measures the norm first and steps every layer, clipped, as its
    gradient lands. The logged losses and gradient norms, and the saved model, equal the same command's
    without it, bit for bit (bf16 compute on host workers, GA 2 through each layer together)."""
    import ast

    import torch
    from safetensors.torch import load_file

    results = {}
    for on in ("false", "true"):
        out = tmp_path / on
        r = train(tmp_path, *common(run_dir, out), "--max_steps", "3", "--gradient_accumulation_steps", "2",
                  "--layer_major_accumulation", "true", "--compute_dtype", "bfloat16", "--background_host_jobs",
                  "true", "--max_grad_norm", "0.01", "--logging_steps", "1", "--save_dtype", "float32",
                  "--transient_grads", on)  # hf_megatrain's INFO lines show by default
        assert r.returncode == 0, r.stderr[-3000:]
        assert ("measures the global gradient norm" in r.stderr) == (on == "true")
        logs = [ast.literal_eval(ln.strip()) for ln in r.stdout.splitlines() if "'grad_norm'" in ln]
        results[on] = ([(log["loss"], log["grad_norm"]) for log in logs], load_file(str(out / "model.safetensors")))
    assert results["true"][0] == results["false"][0] and len(results["true"][0]) == 3
    assert all(float(norm) > 0.01 for _, norm in results["true"][0])  # the clipping acted
    for name, t in results["false"][1].items():
        assert torch.equal(results["true"][1][name], t), name
