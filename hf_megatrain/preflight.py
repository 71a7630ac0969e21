"""Checks that run before any weight is read.

Streaming a 70B model into host RAM takes minutes and hundreds of GiB, so whatever can be known
without the weights is checked first, each failure one line that says what is wrong and what to
do: the output and hub folders (writable, room for a checkpoint), the checkpoint to resume from,
and the data (its columns, and its first rows tokenized as training will tokenize them).

Two more checks live where the work is done, and also run before any weight: the model id
resolves in `checkpoint.loading` (config, tokenizer and a meta skeleton, no weights), and
`planner.admit` refuses a sequence length or placement that does not fit.
"""

from __future__ import annotations

import os
import tempfile
from shutil import disk_usage

from .errors import MegaTrainError

GiB = 1024**3
SAMPLE_ROWS = 16  # rows tokenized ahead of the weights: enough to show a format mistake, quick at any size
SMALL_FILES = 64 * 1024**2  # what a checkpoint holds beside weights and optimizer state (tokenizer, states)


def nearest_existing(path) -> str:
    """`path` itself when it exists, else its closest ancestor that does."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


# -- folders ---------------------------------------------------------------------------------------
def check_writable(path, what: str) -> None:
    """`path` is a folder this process can write in, or one it can create. Nothing is left behind.

    A folder that does not exist yet is not created here (Trainer creates output_dir itself, on the
    processes that save): its nearest existing ancestor is probed instead.
    """
    here = nearest_existing(path)
    if not os.path.isdir(here):
        raise MegaTrainError(f"{what}={os.fspath(path)!r} cannot be a folder: {here} is a file; choose another {what}.")
    if not os.access(here, os.W_OK | os.X_OK):
        raise MegaTrainError(f"{what}={os.fspath(path)!r} is not writable (no write permission on {here}); "
                             f"choose another {what} or change its permissions.")
    try:  # os.access says yes to root on any writable filesystem; only a write shows the rest
        fd, probe = tempfile.mkstemp(prefix=".megatrain-write-check-", dir=here)
    except OSError as e:
        raise MegaTrainError(f"{what}={os.fspath(path)!r} is not writable ({e.strerror} in {here}); "
                             f"choose another {what}.") from e
    os.close(fd)
    os.remove(probe)


def check_outputs(args) -> None:
    """output_dir, and hub_dir when the run publishes, can be written; the loggers `report_to` names
    are installed."""
    check_writable(args.output_dir, "output_dir")
    if args.push_to_hub:
        from .checkpoint.local_hub import default_hub_dir

        check_writable(default_hub_dir(args.hub_dir), "hub_dir")
    check_reporting(args)


# report_to name -> (modules, any of which its callback imports; what to pip install)
REPORTERS = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
    "mlflow": (("mlflow",), "mlflow"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "clearml": (("clearml",), "clearml"),
    "neptune": (("neptune",), "neptune"),
    "codecarbon": (("codecarbon",), "codecarbon"),
    "dvclive": (("dvclive",), "dvclive"),
    "swanlab": (("swanlab",), "swanlab"),
    "dagshub": (("dagshub",), "dagshub mlflow"),
    "azure_ml": (("azureml.core",), "azureml-core"),
    "flyte": (("flytekit",), "flytekit flytekitplugins-deck-standard"),
}


def _installed(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module left as None in sys.modules
        return False


def check_reporting(args) -> None:
    """Every logger in `report_to` is one Trainer knows and its package is installed. Trainer would
    find out only once it builds its callbacks, after the weights, in a traceback ("tensorboard":
    "update your PyTorch version")."""
    names = args.report_to or []
    names = [names] if isinstance(names, str) else list(names)
    try:
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    except ImportError:  # a transformers without that table: Trainer's own message then
        return
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise MegaTrainError(f"report_to={name!r} is not a logger Trainer knows; choose from "
                                 f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))} (or none).")
        modules, package = REPORTERS.get(name, ((), ""))
        if modules and not any(_installed(m) for m in modules):
            raise MegaTrainError(f"report_to={name!r} needs the {package!r} package, which is not installed: "
                                 f"`pip install {package}`, or choose another logger (--report_to none).")


def check_settings(args) -> None:
    """Values that the arguments accept but that fail only later, after the weights are read: what
    HostAdamW refuses (a negative learning rate, weight decay or epsilon, betas outside [0, 1)),
    a negative max_grad_norm, batch sizes or accumulation below 1, and the loggers of `report_to`."""
    problems = []
    for name in ("learning_rate", "weight_decay", "adam_epsilon"):
        value = getattr(args, name)
        if value < 0:
            problems.append(f"{name}={value:g} is negative; AdamW takes {name} >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(args, name)
        if not 0 <= value < 1:
            problems.append(f"{name}={value:g} is outside [0, 1), where AdamW's betas must be")
    if args.max_grad_norm is not None and args.max_grad_norm < 0:
        problems.append(f"max_grad_norm={args.max_grad_norm:g} is negative; give a positive norm to clip to, or 0 "
                        "for no clipping")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if value < 1:
            problems.append(f"{name}={value} must be at least 1")
    if problems:
        raise MegaTrainError("; ".join(problems) + ".")
    check_reporting(args)


# -- resuming --------------------------------------------------------------------------------------
def check_resume(checkpoint, output_dir) -> str | None:
    """The checkpoint folder to resume from (True or 'latest': the last checkpoint-N in output_dir), checked
    complete: optimizer state present and every file of its manifest there at its size. The
    hashes are read later, by the resume itself."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import get_last_checkpoint

    from .checkpoint.manifest import MANIFEST, RESUME_ELSEWHERE, verify_manifest
    from .checkpoint.optimizer_state import has_optimizer_state

    if isinstance(checkpoint, str) and not os.path.isdir(checkpoint):
        # the command line gives strings: True/latest (the last checkpoint) and False/none (no resume)
        word = checkpoint.strip().lower()
        if word in ("true", "latest"):
            checkpoint = True
        elif word in ("false", "none", ""):
            checkpoint = None
    if checkpoint is None or checkpoint is False:
        return None
    if checkpoint is True:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise MegaTrainError(f"resume_from_checkpoint=True, but output_dir={os.fspath(output_dir)!r} holds no "
                                 "checkpoint-N folder; name the checkpoint folder, or start without resuming.")
        checkpoint = last
    path = os.fspath(checkpoint)
    if not os.path.isdir(path):
        raise MegaTrainError(f"resume_from_checkpoint={path!r} is not a folder; name a checkpoint-N folder "
                             "that hf_megatrain wrote (or True for the last one in output_dir).")
    if not has_optimizer_state(path):
        raise MegaTrainError(f"{path} has no hf_megatrain optimizer state; it cannot be resumed exactly. Start a "
                             "new run from it with MegaTrainTrainer(<that folder>, args) instead.")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        verify_manifest(path, hashes=False)
    elif not os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):  # written before manifests were
        raise MegaTrainError(f"{path} has no {TRAINER_STATE_NAME}: the checkpoint is incomplete; {RESUME_ELSEWHERE}")
    return path


# -- data ------------------------------------------------------------------------------------------
def check_data(path, tokenizer, args, what: str = "data_path"):
    """The raw dataset at `path`, once its first rows have tokenized as training will tokenize them
    (format from the columns, chat fields, template, masks, truncation) with a token to learn."""
    import datasets

    from .constants import IGNORE_INDEX
    from .data import load_raw_dataset, progress_bars, tokenize_documents, truncate

    raw = load_raw_dataset(path)  # a missing local path fails here, without a look at the hub
    if len(raw) == 0:
        raise MegaTrainError(f"{what}={path!r} holds no rows; point it at the training data.")
    # an in-memory copy of the first rows: no cache files are written for the sample
    sample = datasets.Dataset.from_dict(raw.with_format(None)[:SAMPLE_ROWS], features=raw.features)
    try:
        with progress_bars(False):  # the bars and the counts are the real tokenization's, later
            docs = tokenize_documents(sample, tokenizer, args.text_field, announce=False)
            if len(docs) == 0:
                raise MegaTrainError(f"no row has a token to learn, every label is {IGNORE_INDEX} (empty texts, or no "
                                     "assistant turn / completion); check the roles and columns")
            if not args.packing:
                truncate(docs, args.max_seq_length)
    except MegaTrainError as e:
        text = " ".join(str(e).split())  # quoted rows and template errors may span lines
        raise MegaTrainError(f"{what}={path!r}, checked on its first {len(sample)} rows: {text}") from e
    return raw


# -- disk ------------------------------------------------------------------------------------------
def checkpoint_bytes(model, args) -> tuple[int, int]:
    """(model files, optimizer state) in bytes for one checkpoint of this run.

    Parameter counts come from `model` (free on a meta skeleton). The model files hold every weight
    at the save dtype (hf_format), or for LoRA the adapters as fp32 (peft_export); the optimizer
    state holds an fp32 master and two fp32 Adam moments per trainable parameter (optimizer_state).
    """
    from .arguments import save_dtype
    from .checkpoint.hf_format import model_dtype
    from .checkpoint.loading import peft_config_from, meta_skeleton
    from .patcher.adapters import base_model, for_layout, is_peft_model

    config = base_model(model).config
    peft_config = args.peft_config
    if peft_config is not None and not is_peft_model(model):
        from peft import get_peft_model

        peft_config = peft_config_from(peft_config)
        try:  # the adapters PEFT will add, on a meta copy: no memory, and a wrong target_modules fails now
            model = get_peft_model(meta_skeleton(config), for_layout(peft_config))
        except (ValueError, TypeError, KeyError) as e:
            text = " ".join(str(e).split())
            raise MegaTrainError(f"peft_config does not fit this {config.model_type} model: {text}; fix "
                                 "target_modules (or the other fields named).") from e
    if is_peft_model(model):
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return 4 * trainable, 12 * trainable
    trainable = sum(p.numel() for p in model.parameters())
    dtype = save_dtype(args) or model_dtype(config)
    return trainable * dtype.itemsize, 12 * trainable


def check_disk(args, model) -> None:
    """Room for one checkpoint in output_dir (and for what publishing copies into hub_dir)."""
    from transformers.trainer_utils import HubStrategy

    weights, optimizer = checkpoint_bytes(model, args)
    keeps_state = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no" and not args.save_only_model
    one = weights + (optimizer if keeps_state else 0) + SMALL_FILES
    needs = [("output_dir", args.output_dir, one)]
    if args.push_to_hub:
        from .checkpoint.local_hub import default_hub_dir

        pushes_checkpoints = args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS)
        needs.append(("hub_dir", default_hub_dir(args.hub_dir), one if pushes_checkpoints else weights + SMALL_FILES))
    per_disk = {}  # one filesystem may hold both folders: their needs add up
    for what, folder, nbytes in needs:
        here = nearest_existing(folder)
        disk = per_disk.setdefault(os.stat(here).st_dev, {"names": [], "bytes": 0, "at": here})
        disk["names"].append(f"{what}={os.fspath(folder)!r}")
        disk["bytes"] += nbytes
    parts, fix = f"model files {weights / GiB:.2f} GiB", "free space or choose another folder"
    if keeps_state:
        parts += f", optimizer state {optimizer / GiB:.2f} GiB"
        fix += ", or save less (save_only_model=True leaves out the optimizer state)"
    for disk in per_disk.values():
        free = disk_usage(disk["at"]).free
        if disk["bytes"] > free:
            raise MegaTrainError(
                f"not enough disk: {' and '.join(disk['names'])} need about {disk['bytes'] / GiB:.2f} GiB for one "
                f"checkpoint ({parts}), and {disk['at']} has {free / GiB:.2f} GiB free; {fix}."
            )
