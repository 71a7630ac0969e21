"""The `hf-megatrain` command.

    hf-megatrain demo                      train the embedded tiny model (no downloads)
    hf-megatrain train --model M --data D --output_dir OUT [any TrainingArguments flag]
    hf-megatrain train --config run.yaml   the same flags from a YAML or JSON file
    hf-megatrain estimate MODEL --batch B --seq T   host RAM and GPU memory a run needs
    hf-megatrain push FOLDER --repo org/name [--hub_dir DIR]   publish a saved model to a local hub
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from functools import partial

from .errors import HostJobError, MegaTrainError


@dataclass
class ModelArguments:
    model: str = field(metadata={"help": "Hub id (already in the local HF cache) or local folder of the model."})
    data: str | None = field(
        default=None, metadata={"help": "Training data: .txt/.jsonl/.json/.parquet file, folder, or cached dataset."}
    )
    eval_data: str | None = field(default=None, metadata={"help": "Evaluation data, same forms as --data."})


def _demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hf-megatrain demo",
        description="Train the embedded tiny Llama to reverse words (CPU ~1 min; uses the GPU when there is one).",
    )
    p.add_argument("--output_dir", default="megatrain_demo", help="where the trained model is saved")
    p.add_argument("--max_steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from .demo import run_demo

    report = run_demo(a.output_dir, max_steps=a.max_steps, seed=a.seed)
    return 0 if report["eval_loss_after"] < report["eval_loss_before"] else 1


def _train(argv: list[str]) -> int:
    from transformers import HfArgumentParser

    from .arguments import MegaTrainArguments

    parser = HfArgumentParser(
        (ModelArguments, MegaTrainArguments),
        prog="hf-megatrain train",
        description="Full fine-tuning of a causal LM through MegaTrainTrainer. Every TrainingArguments flag works.",
    )
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json")):
        argv = ["--config", argv[0]]
    if argv[:1] == ["--config"] and len(argv) >= 2:
        path = argv[1]
        if path.endswith((".yaml", ".yml")):
            margs, targs = parser.parse_yaml_file(os.path.abspath(path))
        else:
            margs, targs = parser.parse_json_file(os.path.abspath(path))
    else:
        margs, targs = parser.parse_args_into_dataclasses(args=argv)
    if margs.data:
        targs.data_path = margs.data
    if margs.eval_data:
        targs.eval_data_path = margs.eval_data
    if not targs.data_path:
        raise MegaTrainError("no training data: pass --data FILE_OR_DATASET.")
    from .trainer import MegaTrainTrainer

    trainer = MegaTrainTrainer(margs.model, targs)
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    trainer.save_model(targs.output_dir)
    _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """The command owns its process: take the process group down in order, every rank together.
    Left to interpreter exit, gloo's threads were torn down in no set order, and once (4 CPU ranks
    under load) one rank aborted after training had finished ("terminate called without an active
    exception"), failing the whole launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _estimate(argv: list[str]) -> int:
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
    p.add_argument("--compute_dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpu_resident_layers", default=None,
                   help="decoder layers kept on the GPU: N, or auto (needs --gpu_gib); default 0, or auto "
                        "with --gpu_gib")
    p.add_argument("--offload_activations", default=None, help="layer inputs kept in host memory: N or auto")
    p.add_argument("--lean_resident", default=None,
                   help="resident layers keep no bf16 copy (cast from the fp32 master per use): true, false or "
                        "auto; default false, or auto with --gpu_gib")
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
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    a = p.parse_args(argv)
    from .engine.config import EngineConfig, parse_count, parse_switch
    from .errors import MegaTrainError
    from .memory import GiB, admit, estimate, longest_fitting_row, mlp_tile, model_shapes, resolve_placement

    def count(value, name):
        try:
            return parse_count(value, name)
        except MegaTrainError:
            raise SystemExit(f"hf-megatrain estimate: --{name} takes a number of layers or 'auto', not {value!r}")

    config = _config_of(a.model)
    resident, offload = count(a.gpu_resident_layers, "gpu_resident_layers"), count(a.offload_activations,
                                                                                  "offload_activations")
    try:
        lean = parse_switch(a.lean_resident, "lean_resident")
    except MegaTrainError:
        raise SystemExit(f"hf-megatrain estimate: --lean_resident takes true, false or auto, not {a.lean_resident!r}")
    if a.gpu_gib is None:  # no machine to place for: what is not given stays off
        if "auto" in (a.gpu_resident_layers, a.offload_activations, a.lean_resident):
            raise SystemExit("hf-megatrain estimate: 'auto' places layers for a machine: give its --gpu_gib")
        resident, offload, lean = resident or 0, offload or 0, bool(lean)
    engine = EngineConfig(device=a.device, compute_dtype=a.compute_dtype, resident_layers=resident,
                          offload_activations=offload, lean_resident=lean,
                          mlp_tile_tokens=mlp_tile(a.seq, a.mlp_tile_tokens))
    ranks = dict(world_size=a.world_size, local_ranks=a.local_ranks)
    shapes = model_shapes(config)
    placement = resolve_placement(config, a.batch, a.seq, engine, gpu_free=a.gpu_gib * GiB if a.gpu_gib else None,
                                  host_free=a.host_gib * GiB if a.host_gib else None, **ranks)
    plan = estimate(config, a.batch, a.seq, placement.engine, shapes=shapes, **ranks)
    verdict = None
    if a.gpu_gib is not None or a.host_gib is not None:
        try:
            hint = None
            if a.gpu_gib is not None and a.host_gib is not None and a.device == "cuda":
                hint = partial(longest_fitting_row, config, a.batch, a.seq, engine=engine, shapes=shapes,
                               mlp_tile_tokens=a.mlp_tile_tokens, **ranks)
            admit(plan, host_free=(a.host_gib or float("inf")) * GiB, gpu_free=(a.gpu_gib or float("inf")) * GiB,
                  hint=hint, residency_planned=placement.planned)
            verdict = "fits"
        except MegaTrainError as e:
            lines = str(e).splitlines()  # the verdict, and the longest row that fits when there is one
            verdict = lines[0] + "".join(f"\n{ln}" for ln in lines[1:] if ln.startswith("max_seq_length="))
    if a.json:
        import json

        print(json.dumps({**plan.as_dict(), "verdict": verdict}, indent=1))
    else:
        print(f"{a.model}: {shapes.params / 1e9:.2f} B parameters, "
              f"{a.batch} x {a.seq} tokens per micro-batch, {a.compute_dtype} compute, "
              f"{plan.resident_layers} layers resident on the GPU"
              f"{' (lean)' if placement.engine.lean_resident and plan.resident_layers else ''}, "
              f"{plan.offload_activations} layer inputs "
              f"offloaded\n")
        print(plan.table())
        if verdict is not None:
            machine = " + ".join(f"{v:g} GiB {k}" for k, v in (("GPU", a.gpu_gib), ("host", a.host_gib)) if v)
            print(f"\non {machine}: {verdict}")
    return 0 if verdict in (None, "fits") else 1


def _config_of(model: str):
    from .shapes import SHAPES, make_config

    if model in SHAPES:
        return make_config(model)
    from transformers import AutoConfig

    from .checkpoint.stream_load import resolve_folder

    try:
        folder = resolve_folder(model)
    except MegaTrainError as e:
        if "/" in model:
            raise
        raise MegaTrainError(f"{e} Or name a known shape: {', '.join(SHAPES)}.") from None
    return AutoConfig.from_pretrained(folder)


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
    a = p.parse_args(argv)
    from .checkpoint.local_hub import LocalHub, default_hub_dir

    if not os.path.isfile(os.path.join(a.folder, "config.json")) and \
            not os.path.isfile(os.path.join(a.folder, "adapter_config.json")):
        raise MegaTrainError(f"{a.folder} holds no config.json or adapter_config.json: not a saved model.")
    hub = LocalHub(default_hub_dir(a.hub_dir), a.repo)
    commit = hub.commit([(a.folder, "")], a.message, ignore=("checkpoint-*", ".partial-*", "runs", "_*"))
    print(f"{a.repo} @ {commit} in {hub.root}")
    return 0


COMMANDS = {"demo": _demo, "train": _train, "estimate": _estimate, "push": _push}


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
