"""The `hf-megatrain` command.

    hf-megatrain demo                      train the embedded tiny model (no downloads)
    hf-megatrain train --model M --data D --output_dir OUT [any TrainingArguments flag]
    hf-megatrain train run.yaml [flags]    the same flags from a YAML or JSON file (flags win)
    hf-megatrain estimate MODEL --batch B --seq T   host RAM, GPU memory and step time of a run
    hf-megatrain probe                     measure this machine's rates for the step-time model
    hf-megatrain push FOLDER --repo org/name [--hub_dir DIR]   publish a saved model to a local hub
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace

from .errors import HostJobError, MegaTrainError


@dataclass
class ModelArguments:
    model: str = field(metadata={"help": "Hub id (already in the local HF cache) or local folder of the model."})
    data: str | None = field(
        default=None, metadata={"help": "Training data: .txt/.jsonl/.json/.parquet file, folder, or cached dataset."}
    )
    eval_data: str | None = field(default=None, metadata={"help": "Evaluation data, same forms as --data."})


def _demo(argv: list[str]) -> int:
    from .demo import DEMO_STEPS  # the package's data only: torch is imported by run_demo

    p = argparse.ArgumentParser(
        prog="hf-megatrain demo",
        description="Train the embedded tiny Llama to reverse words (CPU: under a minute; uses the GPU when there "
                    "is one).",
    )
    p.add_argument("--output_dir", default="megatrain_demo", help="where the trained model is saved")
    p.add_argument("--max_steps", type=int, default=DEMO_STEPS, help=f"optimizer steps (default {DEMO_STEPS})")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from .demo import run_demo

    report = run_demo(a.output_dir, max_steps=a.max_steps, seed=a.seed)
    return 0 if report["eval_loss_after"] < report["eval_loss_before"] else 1


TRAIN_HELP = """usage: hf-megatrain train --model M --data D --output_dir OUT [flags]
       hf-megatrain train RUN.yaml [flags]        (or --config RUN.yaml; flags given here win)

Full fine-tuning (or LoRA) of a causal LM through MegaTrainTrainer. Every TrainingArguments flag
works; the common ones are below, `--help-all` lists them all.

model and data:
  --model M                  hub id (local cache first, then a download) or a local folder
  --data D                   training data: .txt/.jsonl/.json/.parquet file, folder, or dataset
  --eval_data D              evaluation data, the same forms
  --text_field NAME          column with the raw text (default: text)
  --max_seq_length N         tokens per row, packed or truncated (default: 1024)
  --packing true|false       pack short documents into full rows (default: true)
  --peft_config JSON|FILE    train PEFT adapters: inline JSON of LoraConfig fields such as '{"r": 8}', another
                             method's with its peft_type ('{"peft_type": "IA3", ...}'), or a JSON file

training (Trainer's flags):
  --output_dir DIR           where checkpoints and the final model go (required)
  --max_steps N / --num_train_epochs E
  --per_device_train_batch_size B   --gradient_accumulation_steps G
  --learning_rate LR         --weight_decay W   --warmup_steps N   --lr_scheduler_type NAME
  --max_grad_norm C          clipping (0: none; the host AdamW then steps during the backward)
  --logging_steps N          --save_steps N     --save_total_limit N   --eval_steps N
  --resume_from_checkpoint True|latest|DIR   continue a run (True/latest: the last checkpoint in output_dir)
  --seed S                   --report_to none|tensorboard|...
  --push_to_hub true         --hub_model_id ORG/NAME   --hub_dir DIR (a local hub folder)

memory and speed (hf_megatrain):
  --gpu_resident_layers auto|N   layers kept entirely on the GPU (default: as many as fit)
  --lean_resident auto|true|false   resident layers without a bf16 copy (default: when it keeps more)
  --lean_streamed auto|true|false   streamed layers without a bf16 copy in host RAM (default: when the host needs it)
  --transient_grads auto|true|false  no persistent fp32 gradient for decoder layers (with clipping: a norm pass)
  --gpu_grad_layers auto|N   the last streamed layers' fp32 gradients on the GPU (default: when the host needs it)
  --offload_activations auto|N   layer inputs kept in pinned host memory (long context)
  --layer_major_accumulation auto|true|false   a step's micro-batches through each layer together
  --compute_dtype auto|bfloat16|float32   --save_dtype auto|float32|bfloat16
  --mlp_tile_tokens N        --loss_chunk_tokens N   --prefetch_depth N   --host_threads N
  --memory_check true|false  refuse runs that cannot fit, before loading (default: true)
  --max_gpu_memory GIB  --max_host_memory GIB   cap the free memory the plan counts on (a shared card)
  --log_pipeline true|false  --gpu_peak_tflops T   --checkpoint_hashes true|false

See `hf-megatrain estimate MODEL` for what a run needs before starting it.
"""


def _train_parser():
    from transformers import HfArgumentParser

    from .arguments import MegaTrainArguments

    return HfArgumentParser(
        (ModelArguments, MegaTrainArguments),
        prog="hf-megatrain train",
        description="Full fine-tuning of a causal LM through MegaTrainTrainer. Every TrainingArguments flag works.",
    )


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(config file, the other flags): `train RUN.yaml ...` or `... --config RUN.yaml ...`."""
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml", ".json")):
        return argv[0], argv[1:]
    for i, a in enumerate(argv):
        if a == "--config":
            if i + 1 >= len(argv):
                raise MegaTrainError("--config needs a YAML or JSON file.")
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if a.startswith("--config="):
            return a.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def _read_config(path: str) -> dict:
    import json

    import yaml

    if not os.path.isfile(path):
        raise MegaTrainError(f"config file {path!r} does not exist.")
    with open(path) as f:
        data = yaml.safe_load(f) if path.endswith((".yaml", ".yml")) else json.load(f)
    if not isinstance(data, dict):
        raise MegaTrainError(f"{path} must hold a mapping of flag names to values.")
    return data


def _train(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(TRAIN_HELP)  # no torch or transformers import: it opens at once
        return 0
    # Micro-batches of several shapes (packed rows, cut micro-batches: memory.split_step) fragment
    # CUDA's caching allocator near a full card; with expandable segments they do not (BENCHMARKS.md,
    # run 13). It must be set before torch is imported, which the parser does; a value set is kept.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = _train_parser()
    if "--help-all" in argv:
        parser.print_help()
        return 0
    path, flags = _split_config(argv)
    if path is not None:
        # The file's values become the parser's defaults, so flags on the command line win.
        values = _read_config(path)
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            raise MegaTrainError(f"{path}: unknown keys {unknown}; every key must be a flag of `hf-megatrain train`.")
        for action in parser._actions:
            if action.dest in values:
                action.required = False
        parser.set_defaults(**values)
    margs, targs = _parse_train_flags(parser, flags)
    if margs.data:
        targs.data_path = margs.data
    if margs.eval_data:
        targs.eval_data_path = margs.eval_data
    if not targs.data_path:
        raise MegaTrainError("no training data: pass --data FILE_OR_DATASET.")
    # What the arguments accept but the run would refuse only after the weights are read: refused now.
    from .arguments import check_arguments
    from .preflight import check_settings

    check_arguments(targs)
    check_settings(targs)
    strategy = str(getattr(targs.eval_strategy, "value", targs.eval_strategy))
    if strategy != "no" and not targs.eval_data_path:
        raise MegaTrainError(f"eval_strategy={strategy!r} evaluates, but there is no evaluation data: pass "
                             "--eval_data FILE_OR_DATASET, or --eval_strategy no.")
    from .trainer import MegaTrainTrainer

    trainer = MegaTrainTrainer(margs.model, targs)
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    trainer.save_model(targs.output_dir)
    _leave_process_group()
    return 0


def _one_line_error(message: str):
    """argparse's `error`, as one line and no usage block (the usage of every TrainingArguments flag is
    a page): main() prints it and exits with argparse's status 2."""
    raise MegaTrainError(message)


def _parse_train_flags(parser, flags: list[str]):
    """(ModelArguments, MegaTrainArguments) from the flags; every mistake one line (MegaTrainError):
    a flag that does not exist (with the nearest one that does), a value of the wrong type, or a value
    that TrainingArguments refuses when it is built."""
    import difflib

    parser.error = _one_line_error
    _, unknown = parser.parse_known_args(args=flags)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), None)
        if flag is None:
            raise MegaTrainError(f"unexpected value {unknown[0]!r}: every value follows its --flag.")
        name = flag.split("=", 1)[0]
        options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        near = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        hint = f"did you mean {near[0]}? " if near else ""
        raise MegaTrainError(f"no flag {name}; {hint}(`hf-megatrain train --help-all` lists every flag)")
    try:
        margs, targs = parser.parse_args_into_dataclasses(args=flags)
    except ValueError as e:  # TrainingArguments.__post_init__ refusing a value
        raise MegaTrainError(" ".join(str(e).split())) from None
    return margs, targs


def _leave_process_group() -> None:
    """The command owns its process: take the process group down in order, every rank together.
    Left to interpreter exit, gloo's threads were torn down in no set order, and once (4 CPU ranks
    under load) one rank aborted after training had finished ("terminate called without an active
    exception"), failing the whole launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _estimate_parser():
    from .shapes import SHAPES

    p = argparse.ArgumentParser(
        prog="hf-megatrain estimate",
        description="Host RAM and GPU memory needed to train MODEL, component by component. "
                    f"MODEL is a hub id in the local cache, a folder with config.json, or a known shape: "
                    f"{', '.join(SHAPES)}.",
    )
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    p.add_argument("--seq", type=int, default=4096, help="tokens per row")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--layer_major_accumulation", default="auto",
                   help="run a step's micro-batches through each layer together: auto (with --gpu_gib and "
                        "--host_gib, decided as the trainer decides it, cutting micro-batches into chunks of rows "
                        "where that fits), true or false")
    p.add_argument("--compute_dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpu_resident_layers", default=None,
                   help="decoder layers kept on the GPU: N, or auto (needs --gpu_gib); default 0, or auto "
                        "with --gpu_gib")
    p.add_argument("--offload_activations", default=None, help="layer inputs kept in host memory: N or auto")
    p.add_argument("--lean_resident", nargs="?", const="true", default=None,
                   help="resident layers keep no bf16 copy (cast from the fp32 master per use): true (the bare "
                        "flag), false or auto; default false, or auto with --gpu_gib")
    p.add_argument("--lean_streamed", nargs="?", const="true", default=None,
                   help="streamed layers keep no bf16 copy in host RAM, the fp32 master streams (16 instead of 18 "
                        "bytes per parameter, twice the PCIe bytes): true (the bare flag), false or auto; default "
                        "false, or auto with --gpu_gib and --host_gib")
    p.add_argument("--transient_grads", nargs="?", const="true", default=None,
                   help="decoder layers keep no persistent fp32 gradient; each is stepped as it lands (with "
                        "clipping, after a norm pass: one more forward and backward): true (the bare flag), false or auto; default false, or auto with "
                        "--max_grad_norm 0, --gpu_gib and --host_gib")
    p.add_argument("--gpu_grad_layers", default=None,
                   help="the last N streamed layers keep their fp32 gradient on the GPU (4 bytes per parameter "
                        "moved from the host): N or auto; default 0, or auto with --gpu_gib and --host_gib")
    p.add_argument("--mlp_tile_tokens", type=int, default=None,
                   help="MLP sequence tile (default: 16384 for rows longer than 32K tokens, as the trainer)")
    p.add_argument("--gpu_gib", type=float, default=None,
                   help="plan for a GPU with this much free memory: place layers and activations as the "
                        "trainer would, and say whether the run fits (with --host_gib)")
    p.add_argument("--host_gib", type=float, default=None, help="... and a host with this much available RAM")
    p.add_argument("--world_size", type=int, default=1,
                   help="data-parallel ranks in all: each keeps 1/world_size of the fp32 state and a whole "
                        "compute copy")
    p.add_argument("--local_ranks", type=int, default=None,
                   help="how many of those ranks run on one host (default: all); --host_gib is that host's RAM")
    p.add_argument("--max_grad_norm", type=float, default=1.0,
                   help="gradient clipping as the run will have it (0: none; the step-time model's host AdamW "
                        "then overlaps the backward)")
    p.add_argument("--peft_config", default=None, metavar="JSON|FILE",
                   help="plan a PEFT run: its adapters as inline JSON of LoraConfig fields (e.g. "
                        "'{\"r\": 8, \"target_modules\": [\"q_proj\", \"v_proj\"]}'), of another method's "
                        "config with its peft_type, or a JSON file, as MegaTrainArguments.peft_config takes them; "
                        "the fp32 master, gradient and Adam moments then cover the adapters alone, the frozen "
                        "weights only their compute copy")
    p.add_argument("--optim", default="adamw_torch",
                   help="what steps the run, as TrainingArguments.optim: adamw_torch (the default), adamw_torch_fused "
                        "(both the engine's host AdamW), sgd, adagrad, rmsprop or adafactor; its state per parameter "
                        "and its host step's rate")
    p.add_argument("--optim_args", default=None, metavar="K=V,...",
                   help="as TrainingArguments.optim_args, e.g. 'momentum=0.9,nesterov=True' for sgd")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return p


def _estimate_request(a):
    """(Request, Machine) of the parsed flags: what plan_run settles for the trainer, from the command line."""
    from .engine.config import EngineConfig, parse_count, parse_switch
    from .planner.estimator import ADAMW_OPTIMS, GiB, mlp_tile
    from .planner import Machine, Request

    def parsed(name, parse, takes):
        try:
            return parse(getattr(a, name), name)
        except MegaTrainError:
            raise SystemExit(f"hf-megatrain estimate: --{name} takes {takes}, not {getattr(a, name)!r}")

    counts = {f: parsed(f, parse_count, "a number of layers or 'auto'")
              for f in ("gpu_resident_layers", "offload_activations", "gpu_grad_layers")}
    switches = {f: parsed(f, parse_switch, "true, false or auto")
                for f in ("lean_resident", "lean_streamed", "transient_grads", "layer_major_accumulation")}
    if a.gpu_grad_layers is not None and counts["gpu_grad_layers"] is None and not (a.gpu_gib and a.host_gib):
        raise SystemExit("hf-megatrain estimate: --gpu_grad_layers auto weighs the host against the GPU: give "
                         "--gpu_gib and --host_gib")
    placing = (a.gpu_resident_layers, a.offload_activations, a.lean_resident, a.lean_streamed)
    if a.gpu_gib is None and "auto" in placing:
        raise SystemExit("hf-megatrain estimate: 'auto' places layers for a machine: give its --gpu_gib")
    engine = EngineConfig(device=a.device, compute_dtype=a.compute_dtype,
                          mlp_tile_tokens=mlp_tile(a.seq, a.mlp_tile_tokens),
                          resident_layers=counts["gpu_resident_layers"], offload_activations=counts["offload_activations"],
                          lean_resident=switches["lean_resident"], lean_streamed=switches["lean_streamed"],
                          transient_grads=switches["transient_grads"], gpu_grad_layers=counts["gpu_grad_layers"])
    given = a.gpu_gib is not None or a.host_gib is not None
    peft_config = None
    if a.peft_config is not None:
        from .checkpoint.loading import peft_config_from

        try:
            peft_config = peft_config_from(a.peft_config)
        except MegaTrainError as e:
            raise SystemExit(f"hf-megatrain estimate: --peft_config: {e}")
    request = Request(engine, a.batch, a.seq, grad_accum=a.grad_accum, layer_major=switches["layer_major_accumulation"],
                      max_grad_norm=a.max_grad_norm, world_size=a.world_size, local_ranks=a.local_ranks,
                      peft_config=peft_config, admit=given,
                      suggest_row=a.gpu_gib is not None and a.host_gib is not None, mlp_tile_tokens=a.mlp_tile_tokens,
                      optimizer="adamw" if a.optim in ADAMW_OPTIMS else a.optim, optim_args=a.optim_args)
    try:
        request.optimizer_state  # an optim the engine does not run, or optim_args Trainer cannot read: now
    except MegaTrainError as e:
        raise SystemExit(f"hf-megatrain estimate: --optim / --optim_args: {e}")
    from .planner import probe

    rates = probe.rates_for_planning() if a.device == "cuda" and a.world_size == 1 else None
    if rates is probe.REFERENCE and probe.gpu_name() is None:  # a probe here measures no GPU: no advice to run it
        rates = replace(rates, measured="reference rates of an H200 box with 16 host cores (no GPU here to "
                                        "probe; `hf-megatrain probe` on the GPU machine measures its own)")
    return request, Machine(a.gpu_gib * GiB if a.gpu_gib else None, a.host_gib * GiB if a.host_gib else None, rates)


def _estimate(argv: list[str]) -> int:
    """Parse the flags, plan the run as the trainer would (planner.plan_run), print the plan."""
    from .planner import plan_run, report

    a = _estimate_parser().parse_args(argv)
    request, machine = _estimate_request(a)
    config = _config_of(a.model, record=not a.peft_config)  # adapters lay out from the real config
    run = plan_run(config, request, machine)
    modes = report.mode_rows(config, request, run, machine)
    if a.json:
        import json

        print(json.dumps(report.as_dict(request, run, modes), indent=1))
    else:
        print(report.as_text(a.model, config, request, run, machine, modes))
    return 0 if report.verdict(request, run) in (None, "fits") else 1


def _config_of(model: str, record: bool = True):
    """The model's config. record: a ConfigRecord where an earlier estimate laid the same config out
    (planner.layout_cache.cached_config: no transformers import, the bulk of a warm estimate's time)."""
    from .planner.layout_cache import cached_config
    from .shapes import SHAPES, make_config, shape_fields

    if model in SHAPES:
        key = ("shape", shape_fields(model))
        return cached_config(key, lambda: make_config(model)) if record else make_config(model)
    from .checkpoint.stream_load import resolve_folder

    try:
        folder = resolve_folder(model, files=["config.json"])  # a hub id: its config only
    except MegaTrainError as e:
        if "/" in model:
            raise
        raise MegaTrainError(f"{e} Or name a known shape: {', '.join(SHAPES)}.") from None

    def build():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder)

    try:
        with open(os.path.join(folder, "config.json")) as f:
            key = ("config.json", f.read())
    except OSError:
        return build()  # AutoConfig says what is wrong with the folder
    return cached_config(key, build) if record else build()


def _push(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hf-megatrain push",
        description="Publish a saved model folder (config, safetensors, tokenizer) as a new commit of a LOCAL hub "
                    "in the standard HF cache layout; nothing is uploaded. Load it with HF_HUB_CACHE=<hub_dir> "
                    "HF_HUB_OFFLINE=1 and from_pretrained('org/name').",
    )
    p.add_argument("folder", help="a folder written by save_model / save_pretrained")
    p.add_argument("--repo", required=True, help="repository id, e.g. my-org/my-model")
    p.add_argument("--hub_dir", default=None, help="the hub cache folder (default: $HF_HUB_CACHE)")
    p.add_argument("--message", default="Upload with hf-megatrain push")
    p.add_argument("--with_training_state", action="store_true",
                   help="also publish a checkpoint's optimizer state, scheduler, RNG and trainer state (left out by "
                        "default, as Trainer's push leaves them out: the optimizer state alone is 12 bytes per "
                        "parameter, 3x an fp32 model)")
    a = p.parse_args(argv)
    from .checkpoint.local_hub import TRAINING_STATE, LocalHub, default_hub_dir, training_state_files

    if not os.path.isfile(os.path.join(a.folder, "config.json")) and \
            not os.path.isfile(os.path.join(a.folder, "adapter_config.json")):
        raise MegaTrainError(f"{a.folder} holds no config.json or adapter_config.json: not a saved model.")
    hub = LocalHub(default_hub_dir(a.hub_dir), a.repo)
    ignore = ("checkpoint-*", ".partial-*", "runs", "_*")
    left_out = [] if a.with_training_state else training_state_files(a.folder)
    commit = hub.commit([(a.folder, "")], a.message, ignore=ignore + (() if a.with_training_state else TRAINING_STATE))
    print(f"{a.repo} @ {commit} in {hub.root}")
    if left_out:
        size = sum(os.path.getsize(os.path.join(a.folder, n)) for n in left_out)
        print(f"left out the training state ({len(left_out)} files, {size / 1024**2:,.1f} MiB: optimizer, scheduler, "
              f"RNG); --with_training_state publishes it too")
    return 0


def _probe(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hf-megatrain probe",
        description="Measure this machine's rates (bf16 matmul under sustained load, pinned PCIe each way and both "
                    "ways at once, GPU memory, host DRAM, the engine's host AdamW) in about 20 seconds, and cache "
                    "them for `hf-megatrain estimate` and the trainer's step-time model.",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of matmul load before the rate is taken")
    p.add_argument("--no_save", action="store_true", help="print only; keep the cache as it is")
    p.add_argument("--json", action="store_true", help="print the rates as JSON")
    a = p.parse_args(argv)
    if a.seconds <= 0:
        raise MegaTrainError(f"--seconds must be positive, not {a.seconds:g}")
    from dataclasses import asdict

    from .planner import probe

    rates = probe.measure(a.seconds, progress=(lambda line: None) if a.json else
                          (lambda line: print(line, file=sys.stderr, flush=True)))
    path = None if a.no_save else probe.save(rates)
    if a.json:
        import json

        print(json.dumps({**asdict(rates), "cache": path}, indent=1))
    else:
        print(rates.table())
        if not rates.gpu:
            print("no GPU here: only the host's rates were measured")
        if path:
            print(f"cached in {path}")
    return 0


COMMANDS = {"demo": _demo, "train": _train, "estimate": _estimate, "probe": _probe, "push": _push}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nRun `hf-megatrain COMMAND --help` for the flags of one command.")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"hf-megatrain: unknown command {cmd!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[cmd](rest)
    except MegaTrainError as e:
        print(f"hf-megatrain {cmd}: error: {e}", file=sys.stderr)
        return 2
    except HostJobError as e:  # the failed thread's traceback is in the message; the main thread's is noise
        print(f"hf-megatrain {cmd}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
