"""Data parallel on the CPU with gloo: N ranks equal one process on the same global batch."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from tests.support import ROOT, dp_worker
from tests.support.tiny import make_model


# (model, dtype on disk, compute dtype): fp32 on disk with bf16 compute is read in parts (the
# rank's master slice exactly, the rest only rounded into the compute copy); bf16 on disk with
# bf16 compute goes byte for byte into the compute copy; Mixtral's experts land in rows of fused
# parameters; the tied Llama's head has no weight of its own.
STORE_CASES = [("llama", torch.float32, torch.bfloat16), ("llama_tied", torch.float32, torch.float32),
               ("mixtral", torch.bfloat16, torch.bfloat16), ("mixtral", torch.float32, torch.bfloat16)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def spawned(request, tmp_path_factory):
    """One spawn of N gloo ranks (dp_worker.rank_main) serves the engine and the store tests."""
    world, tmp = request.param, tmp_path_factory.mktemp("spawned")
    cases = []
    for kind, disk, compute in STORE_CASES:
        folder = tmp / f"{kind}-{str(disk)[6:]}"
        if not folder.exists():  # several shards, so tensors come from more than one file
            make_model(kind, seed=3).to(disk).save_pretrained(folder, max_shard_size="50KB")
        cases.append((f"{kind}, {disk} on disk, {compute} compute", str(folder), compute))
    out = str(tmp / "out")
    mp.start_processes(dp_worker.rank_main, args=(world, str(tmp / "init"), cases, out), nprocs=world,
                       start_method="spawn")
    return world, out, cases


def test_engine_data_parallel_matches_one_process(spawned):
    _, out, _ = spawned
    got = torch.load(f"{out}.pt")
    ref_masters, ref_norms = dp_worker.train_engine("llama_tied", dp_worker.global_batches(3, 4))
    for a, b in zip(got["norms"], ref_norms):
        assert abs(a - b) <= 1e-5 * max(1, b), (got["norms"], ref_norms)
    for name, t in ref_masters.items():
        torch.testing.assert_close(got["masters"][name], t, atol=1e-5, rtol=1e-5, msg=name)


def test_folder_load_gives_each_rank_what_from_model_gives(spawned):
    """Several ranks loading a checkpoint folder: each rank's master slices and compute copies
    equal, byte for byte, those HostStore.from_model builds from the model transformers loads."""
    world, out, cases = spawned
    for rank in range(world):
        got = torch.load(f"{out}.{rank}")
        for name, _, _ in cases:
            mine, ref = got[name]["folder"], got[name]["from_model"]
            assert mine["bounds"] == ref["bounds"], name
            if rank:  # the slices are real: this rank holds only part of a unit's master
                assert all(lo > 0 for lo, _ in mine["bounds"]), (name, mine["bounds"])
            for kind in ("master", "compute"):
                for u, (x, y) in enumerate(zip(mine[kind], ref[kind])):
                    assert x.dtype == y.dtype and x.shape == y.shape, (name, rank, kind, u)
                    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (name, rank, kind, u)


def test_estimate_counts_what_each_rank_allocates(spawned):
    """Admission's host figure per rank at N ranks is what the rank with the largest slices
    allocates: the whole compute copy, 1/N of the fp32 master, gradient and Adam moments."""
    from hf_megatrain.planner.estimator import estimate

    world, out, cases = spawned
    got = [torch.load(f"{out}.{rank}") for rank in range(world)]
    for (kind, _, dtype), (name, _, _) in zip(STORE_CASES, cases):
        plan = estimate(make_model(kind).config, 1, 16, compute_dtype=str(dtype)[6:], device="cpu", world_size=world)
        counted = plan.host_total - plan.host["runtime (torch, CUDA, Python)"] - \
            plan.host["data-parallel exchange (one unit)"]  # transient: not in the arenas
        allocated = max(g[name]["allocated"]["bytes"] for g in got)
        # the arenas round each unit up to a 4 KiB page; nothing else may differ
        assert counted <= allocated <= counted + 4096 * got[0][name]["allocated"]["slots"], (name, counted, allocated)


def launch(world, out, batch, *opts, port):
    """Start `world` processes the way torchrun does (environment variables) and wait for them."""
    import subprocess
    import sys

    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.dp_trainer", str(out), str(batch), *opts],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    import json

    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_run(a, b, from_step=0, tol=1e-5):
    la = [x for x in a["logs"] if x["step"] > from_step]
    lb = [x for x in b["logs"] if x["step"] > from_step]
    assert [x["step"] for x in la] == [x["step"] for x in lb]
    for x, y in zip(la, lb):
        for k in ("loss", "grad_norm", "learning_rate"):
            assert abs(x[k] - y[k]) <= tol * max(1.0, abs(x[k])), (k, x, y)
    for name, t in a["masters"].items():
        torch.testing.assert_close(torch.as_tensor(b["masters"][name]), torch.as_tensor(t), atol=tol, rtol=tol,
                                   msg=name)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return launch(1, out, 4, port=_free_port())


def test_trainer_two_ranks_match_one_process(tmp_path, single):
    two = launch(2, tmp_path, 2, port=_free_port())
    assert two["world"] == 2
    assert_same_run(single, two)


def test_save_with_two_ranks_resume_with_one(tmp_path, single):
    launch(2, tmp_path / "run", 2, "--save", "3", port=_free_port())
    ckpt = tmp_path / "run" / "checkpoint-3"
    files = sorted(os.listdir(ckpt))
    assert any("-r00001-" in f for f in files), files  # rank 1 wrote its own optimizer slice
    resumed = launch(1, tmp_path / "run", 4, "--resume", str(ckpt), port=_free_port())
    assert_same_run(single, resumed, from_step=3)


# -- the other optimizers: sgd, adagrad and rmsprop shard their state; Adafactor is refused ------

ELEMENTWISE = {"sgd": "momentum=0.9,nesterov=True", "adagrad": "lr_decay=0.01",
               "rmsprop": "momentum=0.5,alpha=0.9,centered=True,eps=1e-4"}
GA = 2  # micro-batches per step: 2 ranks x 2 rows x GA 2 = 1 process x 4 rows x GA 2


def optim_flags(optim):
    return ["--optim", optim, "--optim_args", ELEMENTWISE[optim], "--ga", str(GA)]


def stock_run(optim, out):
    """Stock Trainer with the same optim on the same rows, one process (tests/support/dp_trainer's run)."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    from tests.support.dp_trainer import TRAINING, train_rows

    model = make_model("llama")
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(out), per_device_train_batch_size=4,
                                                          gradient_accumulation_steps=GA, optim=optim,
                                                          optim_args=ELEMENTWISE[optim], save_strategy="no",
                                                          **TRAINING),
                      train_dataset=train_rows(), data_collator=default_data_collator)
    trainer.train()
    logs = [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate")} for h in trainer.state.log_history
            if "loss" in h]
    return {"logs": logs, "masters": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module", params=list(ELEMENTWISE))
def elementwise_runs(request, tmp_path_factory):
    """One optimizer's runs: one process, two ranks (saving at step 3), and stock Trainer."""
    optim, root = request.param, tmp_path_factory.mktemp(request.param)
    one = launch(1, root / "one", 4, *optim_flags(optim), port=_free_port())
    two = launch(2, root / "two", 2, "--save", "3", *optim_flags(optim), port=_free_port())
    return optim, root, one, two, stock_run(optim, root / "stock")


def test_elementwise_optimizers_two_ranks_match_one_process_and_stock(elementwise_runs):
    """sgd (momentum, nesterov), adagrad and rmsprop (centered, momentum) with two ranks, each stepping its slice
    of every unit with the stock class, clipped at every step, GA 2: one process's and stock Trainer's losses,
    grad norms, learning rates and final weights, to 1e-6."""
    _, _, one, two, stock = elementwise_runs
    assert one["world"] == 1 and two["world"] == 2
    assert min(x["grad_norm"] for x in stock["logs"]) > 0.5  # clipping active at every step
    assert_same_run(stock, one, tol=1e-6)
    assert_same_run(stock, two, tol=1e-6)


def saved_state(ckpt):
    """{(unit, key): the whole flat tensor}, joined from every rank's files: `master`, and each piece's state
    (`<unit>.<key>.<start>`)."""
    from safetensors import safe_open

    parts = {}
    for fname in sorted(os.listdir(ckpt)):
        if fname.startswith("megatrain_optimizer-r"):
            with safe_open(os.path.join(ckpt, fname), framework="pt") as f:
                for name in f.keys():
                    unit, key, *start = name.split(".")
                    parts.setdefault((int(unit), key), []).append((int(start[0]) if start else None, fname,
                                                                   f.get_tensor(name)))
    meta = json.loads((ckpt / "megatrain_optimizer.json").read_text())
    out = {}
    for (unit, key), got in parts.items():
        if key == "master":  # one tensor per rank: its range from the index
            where = {fname: lo for fname, lo, _ in meta["pieces"][str(unit)]}
            got = [(where[fname], fname, t) for _, fname, t in got]
        out[unit, key] = torch.cat([t for _, _, t in sorted(got, key=lambda g: g[0])])
    return out, meta


def test_elementwise_state_saved_by_two_ranks_resumes_bit_for_bit(elementwise_runs, tmp_path):
    """Two ranks save their slices of every piece's state; one process reads them back bit for bit (masters,
    each state tensor joined over the ranks, the step counters); two ranks resumed from it finish exactly as
    the uninterrupted run; one process resumed from it, as the one-process run to 1e-6 (its first three steps
    summed two ranks' gradients)."""
    from transformers import default_data_collator

    from hf_megatrain import MegaTrainArguments, MegaTrainTrainer
    from hf_megatrain.checkpoint.optimizer_state import load_optimizer_state
    from tests.support.dp_trainer import TRAINING, train_rows

    optim, root, one, two, _ = elementwise_runs
    ckpt = root / "two" / "checkpoint-3"
    saved, meta = saved_state(ckpt)
    assert meta["world"] == 2 and meta["optimizer"] == optim
    keys = {"sgd": {"momentum_buffer"}, "adagrad": {"sum"}, "rmsprop": {"square_avg", "momentum_buffer", "grad_avg"}}
    assert {k for _, k in saved} == {"master"} | keys[optim]
    assert any("-r00001-" in f for f, _, _ in meta["piece_state"]["1"]["tensors"][min(keys[optim])])  # rank 1's
    args = MegaTrainArguments(output_dir=str(tmp_path / "read"), per_device_train_batch_size=4, **TRAINING,
                              gradient_accumulation_steps=GA, optim=optim, optim_args=ELEMENTWISE[optim],
                              log_pipeline=False)
    trainer = MegaTrainTrainer(make_model("llama", seed=7), args, train_dataset=train_rows(),
                               data_collator=default_data_collator)
    trainer.create_optimizer()
    opt = trainer.host_optimizer
    load_optimizer_state(opt, str(ckpt))
    assert opt.step_count == 3
    for unit in opt.store.units:
        assert torch.equal(opt.store.master[unit.index], saved[unit.index, "master"]), unit.label
        pieces = opt.piece_state(unit.index)
        for key in keys[optim]:
            assert torch.equal(torch.cat([state[key] for _, _, state in pieces]), saved[unit.index, key])
        if optim != "sgd":  # torch's per-parameter step counters: three steps, in every piece
            assert all(float(state["step"]) == 3.0 for _, _, state in pieces)
    again = launch(2, tmp_path / "two", 2, "--resume", str(ckpt), *optim_flags(optim), port=_free_port())
    assert [x for x in again["logs"] if x["step"] > 3] == [x for x in two["logs"] if x["step"] > 3]
    assert again["masters"] == two["masters"]
    alone = launch(1, tmp_path / "one", 4, "--resume", str(ckpt), *optim_flags(optim), port=_free_port())
    assert_same_run(one, alone, from_step=3, tol=1e-6)


def test_adafactor_with_two_ranks_is_refused_in_one_line(tmp_path):
    """Adafactor's factored second moment and update RMS span whole parameters, which a rank's slice cuts:
    each rank refuses before it reads a weight, in one line naming what shards."""
    port, procs = _free_port(), []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.support.dp_trainer", str(tmp_path), "2",
                                       "--optim", "adafactor"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode != 0
        line = err.strip().splitlines()[-1]
        assert "optim='adafactor' is not combined with data parallel (world size > 1)" in line, err[-3000:]
        assert "use 'sgd', 'adagrad', 'rmsprop' or 'adamw_torch'" in line


# -- real launchers: `hf-megatrain train` from a folder and from a hub id in the local cache -----

GLOBAL_BATCH = 4  # rows per optimizer step, whatever the number of ranks


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny Llama with its tokenizer, as a folder and as `org/tiny` in a local hub cache, and data."""
    from hf_megatrain.checkpoint.local_hub import LocalHub
    from hf_megatrain.demo import build_tokenizer

    root = tmp_path_factory.mktemp("sources")
    folder = root / "tiny"
    make_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    LocalHub(str(root / "hub"), "org/tiny").commit([(str(folder), "")], "a tiny llama")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"text": "abcdefghij"[i % 7:] + " xyz" * (i % 5)}) + "\n" for i in range(40)))
    return {"folder": str(folder), "hub": "org/tiny", "hub_cache": str(root / "hub"), "data": str(data)}


def start_cli(launcher, ranks, source, sources, out, cpu=True):
    """Start `hf-megatrain train` under a real launcher with `ranks` processes on the CPU (gloo);
    its output goes to OUT.log."""
    port = str(_free_port())
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", port]
    elif ranks == 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1"]
    else:  # accelerate starts several processes only through its torchrun launcher; --cpu would start one
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(ranks),
               "--main_process_port", port]
    cli = shutil.which("hf-megatrain", path=os.path.dirname(sys.executable)) or "hf-megatrain"
    cmd += ["--no_python", cli, "train", "--model", sources[source], "--data", sources["data"],
            "--output_dir", str(out),
            "--max_steps", "3", "--per_device_train_batch_size", str(GLOBAL_BATCH // ranks), "--max_seq_length", "16",
            "--learning_rate", "1e-2", "--warmup_steps", "1", "--max_grad_norm", "0.5", "--weight_decay", "0.1",
            "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "3", "--report_to", "none",
            "--disable_tqdm", "true", "--train_sampling_strategy", "sequential", "--log_pipeline", "false",
            "--seed", "0"] + (["--use_cpu"] if cpu else [])
    os.makedirs(f"{out}-tmp")  # the launchers' own files (torchelastic logs) stay in the test's folder
    env = dict(os.environ, HF_HUB_CACHE=sources["hub_cache"], HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_DATASETS_CACHE=f"{out}-datasets", TMPDIR=f"{out}-tmp", PYTHONPATH=ROOT)
    log = open(f"{out}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log


def finish(started, out):
    """Wait for a started run; its return code and output."""
    proc, log = started
    proc.wait(timeout=600)
    log.close()
    with open(f"{out}.log") as f:
        return proc.returncode, f.read()


def cli_result(started, out):
    """The launched run's logged steps (its checkpoint's trainer state) and the weights it saved."""
    from safetensors.torch import load_file

    code, output = finish(started, out)
    assert code == 0, output[-4000:]
    with open(out / "checkpoint-3" / "trainer_state.json") as f:
        logs = [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate")}
                for h in json.load(f)["log_history"] if "loss" in h]
    assert len(logs) == 3
    return {"logs": logs, "masters": load_file(out / "model.safetensors")}  # saved in fp32: the masters


@pytest.fixture(scope="module")
def one_process(sources, tmp_path_factory):
    """One process with torchrun from the folder (the reference) and with accelerate from the hub
    id, run side by side (each uses one core)."""
    root = tmp_path_factory.mktemp("one")
    runs = [("torchrun", "folder"), ("accelerate", "hub")]
    started = [start_cli(launcher, 1, source, sources, root / launcher) for launcher, source in runs]
    return {run: cli_result(s, root / run[0]) for run, s in zip(runs, started)}


@pytest.mark.slow
def test_one_process_from_folder_and_from_hub_id(one_process):
    """torchrun from the folder and accelerate launch from the hub id: the same run, to the bit."""
    a, b = one_process[("torchrun", "folder")], one_process[("accelerate", "hub")]
    assert a["logs"] == b["logs"]
    assert a["masters"].keys() == b["masters"].keys()
    assert all(torch.equal(t, b["masters"][n]) for n, t in a["masters"].items())


# Each launcher with 2 and 4 ranks, each number of ranks from a folder and from a hub id.
@pytest.mark.slow
@pytest.mark.parametrize("launcher,source,ranks", [("torchrun", "hub", 2), ("accelerate", "folder", 2),
                                                   ("torchrun", "folder", 4), ("accelerate", "hub", 4)])
def test_launcher_matches_one_process(launcher, source, ranks, sources, one_process, tmp_path):
    out = tmp_path / "out"
    run = cli_result(start_cli(launcher, ranks, source, sources, out), out)
    # gradients are summed over ranks in another order: equal up to fp32 rounding
    assert_same_run(one_process[("torchrun", "folder")], run)


@pytest.mark.slow
def test_processes_without_a_process_group_are_refused(sources, tmp_path):
    """torchrun without --use_cpu on a machine without a GPU: two lone trainings into one output_dir
    are refused before any weight is read (the weights file here is not even readable)."""
    folder, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(sources["folder"], folder)
    (folder / "model.safetensors").write_bytes(b"not read")
    code, output = finish(start_cli("torchrun", 2, "folder", dict(sources, folder=str(folder)), out, cpu=False), out)
    assert code != 0
    assert output.count("Add --use_cpu") == 2, output[-3000:]  # each rank says so
    assert "safetensors" not in output and not out.exists()
