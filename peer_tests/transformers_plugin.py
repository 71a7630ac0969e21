"""pytest plugin for running transformers' own tests/trainer files against hf_megatrain.

Loaded by run_transformers_trainer.py with `-p transformers_plugin` (this folder on PYTHONPATH).
It does four things, the same in both modes except the class swap:

* PEER_TF_MODE=engine: `transformers.Trainer` / `transformers.TrainingArguments` become
  MegaTrainTrainer / MegaTrainArguments before any test module is imported, so the unmodified
  files (`from transformers import Trainer, TrainingArguments`) build the engine.
* Offline fixtures: the hub ids and datasets that the decoder-LM tests load are served locally.
  Tiny random models (hidden 64, 2 layers) with a byte-level tokenizer are written once into a
  hub-cache folder (HF_HUB_CACHE, read with HF_HUB_OFFLINE=1); `datasets.load_dataset` returns
  generated text for the two dataset ids those tests use. Any other hub id fails offline, and
  such a test is reported skipped, naming what it wanted (no local stand-in).
* A per-test time limit (PEER_TF_TIMEOUT seconds, SIGALRM).
* One JSON line per test in PEER_TF_RESULTS: outcome, a one-line reason, where an engine
  failure was raised, and which kinds of model the test handed to a Trainer ("causal-lm" or a
  toy module), which is how the harness tells decoder-LM tests from toy regression tests.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import time
import traceback
import types

import pytest

MODE = os.environ.get("PEER_TF_MODE", "stock")
FIXTURES = os.environ.get("PEER_TF_FIXTURES", "/tmp/peer_transformers/fixtures")
RESULTS = os.environ.get("PEER_TF_RESULTS")
TIMEOUT = int(os.environ.get("PEER_TF_TIMEOUT", "600"))
FIXTURE_VERSION = "2"  # bump when the fixtures below change, so an old cache is rebuilt

for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("HF_HUB_CACHE", os.path.join(FIXTURES, "hub"))

# ---------------------------------------------------------------------------------------------
# Fixtures: tiny random stand-ins for the hub ids of the decoder-LM tests
# ---------------------------------------------------------------------------------------------

# hub id -> (model family, tokenizer flavour). The real repos are tiny random models too; only
# sizes and vocabularies differ (ours: a 256-byte vocabulary plus a few specials).
MODELS = {
    "hf-internal-testing/tiny-random-LlamaForCausalLM": ("llama", "llama"),
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", "qwen2"),
    "openai-community/gpt2": ("gpt2", "gpt2"),
}
SPECIALS = {  # token strings and which roles they play, per tokenizer flavour
    "llama": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"},
    "qwen2": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "gpt2": {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
}


def _tokenizer(flavour: str):
    """A byte-level tokenizer with no merges: every text encodes, one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    roles = SPECIALS[flavour]
    specials = list(dict.fromkeys(roles.values()))
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if flavour == "llama":  # Llama prepends <s>
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=64, **roles)


def _model(family: str, tokenizer):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = len(tokenizer)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=128, n_embd=64, n_layer=2, n_head=4, **ids))
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **ids)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))


def build_fixtures(hub: str) -> None:
    """Write each stand-in in the hub-cache layout (models--org--name/snapshots/<rev>, refs/main)."""
    stamp = os.path.join(hub, f".peer_fixtures_v{FIXTURE_VERSION}")
    if os.path.exists(stamp):
        return
    rev = "0" * 39 + FIXTURE_VERSION
    for repo_id, (family, flavour) in MODELS.items():
        repo = os.path.join(hub, "models--" + repo_id.replace("/", "--"))
        tokenizer = _tokenizer(flavour)
        _model(family, tokenizer).save_pretrained(os.path.join(repo, "snapshots", rev))
        tokenizer.save_pretrained(os.path.join(repo, "snapshots", rev))
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(rev)
    open(stamp, "w").close()


WORDS = ("the model trains one layer at a time while the host keeps every weight and state of the run "
         "in memory gradient accumulation clipping and evaluation behave as the stock trainer does").split()


def _text_rows(n: int, seed: int, empty_every: int = 0) -> list[str]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        rows.append("" if empty_every and i % empty_every == 0 else " ".join(rng.choices(WORDS, k=rng.randint(4, 30))))
    return rows


def _local_dataset(path, name=None, split=None, **kwargs):
    """Stand-ins for the hub datasets the decoder-LM tests read; None for any other id."""
    from datasets import Dataset, DatasetDict

    if path == "Salesforce/wikitext":  # text rows, some empty as in wikitext
        full = DatasetDict({"train": Dataset.from_dict({"text": _text_rows(400, 0, empty_every=4)})})
    elif path == "fka/awesome-chatgpt-prompts":
        prompts = _text_rows(24, 1)
        full = DatasetDict({"train": Dataset.from_dict({"act": [p.split()[0] for p in prompts], "prompt": prompts})})
    else:
        return None
    if split is None:
        return full
    m = re.fullmatch(r"(\w+)(?:\[:(\d+)\])?", split)
    if not m:
        raise ValueError(f"peer fixture: split {split!r} not understood")
    rows = full[m.group(1)]
    return rows.select(range(int(m.group(2)))) if m.group(2) else rows


# ---------------------------------------------------------------------------------------------
# Per-test records
# ---------------------------------------------------------------------------------------------

_records: dict[str, dict] = {}
_current: dict | None = None


def _model_kind(model) -> str:
    if model is None:
        return "none"
    if isinstance(model, str):
        return "hub-id"
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(base, PreTrainedModel):
        if getattr(base.config, "is_encoder_decoder", False):
            return "encoder-decoder"
        if type(base).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
            return "causal-lm"
        return "pretrained:" + type(base).__name__
    return "toy:" + type(base).__name__


def _recording(init):
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        if _current is not None:
            if MODE == "engine" and not _is_engine(self):  # a Trainer the swap did not reach
                _current["unswapped"].add(type(self).__name__)
            model = args[0] if args else kwargs.get("model")
            if model is None and kwargs.get("model_init") is not None:
                _current["kinds"].add("model_init")
            else:
                _current["kinds"].add(_model_kind(model))
        return init(self, *args, **kwargs)

    return wrapper


def _is_engine(trainer) -> bool:
    from hf_megatrain import MegaTrainTrainer

    return isinstance(trainer, MegaTrainTrainer)


def _swap_classes() -> None:
    import transformers

    import hf_megatrain  # noqa: F401  (imported first: its modules bind the stock classes)
    import hf_megatrain.loop  # noqa: F401
    from hf_megatrain import MegaTrainArguments, MegaTrainTrainer

    transformers.Trainer = MegaTrainTrainer
    transformers.TrainingArguments = MegaTrainArguments
    MegaTrainTrainer.__init__ = _recording(MegaTrainTrainer.__init__)


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------


def pytest_addhooks(pluginmanager):
    # transformers' conftest registers a plugin with pytest-xdist's `pytest_configure_node` hook;
    # without xdist installed pytest refuses the unknown hook, so declare it.
    if not pluginmanager.has_plugin("xdist"):
        from pluggy import HookspecMarker

        specs = types.ModuleType("peer_xdist_hookspecs")

        @HookspecMarker("pytest")
        def pytest_configure_node(node):
            """xdist's hook, declared for transformers' network-debug plugin."""

        specs.pytest_configure_node = pytest_configure_node
        pluginmanager.add_hookspecs(specs)


def pytest_configure(config):
    build_fixtures(os.environ["HF_HUB_CACHE"])
    import datasets
    import transformers.trainer
    import transformers.utils.hub

    original = datasets.load_dataset

    @functools.wraps(original)
    def load_dataset(path, *args, **kwargs):
        local = _local_dataset(path, *args, **kwargs)
        return local if local is not None else original(path, *args, **kwargs)

    datasets.load_dataset = load_dataset
    hub_files = transformers.utils.hub.cached_files

    @functools.wraps(hub_files)
    def cached_files(path_or_repo_id, *args, **kwargs):  # remembers which id a failed load asked for
        try:
            return hub_files(path_or_repo_id, *args, **kwargs)
        except Exception:
            if _current is not None:
                _current["hub_misses"].append(str(path_or_repo_id))
            raise

    transformers.utils.hub.cached_files = cached_files
    transformers.trainer.Trainer.__init__ = _recording(transformers.trainer.Trainer.__init__)
    if MODE == "engine":
        _swap_classes()
    elif MODE != "stock":
        raise pytest.UsageError(f"PEER_TF_MODE must be stock or engine, not {MODE!r}")
    if RESULTS:
        open(RESULTS, "w").close()


class PeerTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise PeerTimeout(f"peer harness: test exceeded {TIMEOUT}s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = {"nodeid": item.nodeid, "phases": {}, "kinds": set(), "unswapped": set(), "hub_misses": [], "start": time.time()}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        _finish(_current)
        _current = None


_OFFLINE = re.compile(r"offline mode|OfflineModeIsEnabled|LocalEntryNotFound|couldn't connect to|Couldn't reach|"
                      r"cannot find the requested files|Can't load .* for '[\w.-]+/[\w.-]+'", re.I)
_QUOTED_ID = re.compile(r"'([\w.-]+/[\w.-]+)'")
# modules the test files import from parts of the transformers repository a peer checkout leaves out
NOT_IN_CHECKOUT = {"run_translation": "examples/pytorch/translation (seq2seq example script, hub encoder-decoders)"}


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _not_runnable_here(exc) -> str | None:
    """A skip reason when the failure is a hub/dataset download refused offline (same rule for
    stock and engine), or an import of a part of the repository the peer checkout lacks."""
    if isinstance(exc, ModuleNotFoundError) and exc.name in NOT_IN_CHECKOUT:
        return f"needs transformers' {NOT_IN_CHECKOUT[exc.name]}, not in the peer checkout"
    for e in _chain(exc):
        text = re.sub(r"https?://\S+", "", f"{type(e).__name__}: {e}")
        if _OFFLINE.search(text):
            ids = _QUOTED_ID.findall(text) or (_current or {}).get("hub_misses", [])[-1:]
            what = repr(ids[0]) if ids else "a hub file"
            return f"offline: needs {what} from the hub; no local stand-in (only the decoder-LM tests' ids have one)"
    return None


def _one_line(exc) -> str:
    lines = [l.strip() for l in traceback.format_exception_only(type(exc), exc)[-1].splitlines() if l.strip()]
    line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _where(tb) -> dict:
    """The innermost frame overall, and the innermost one inside hf_megatrain."""
    frames = traceback.extract_tb(tb)
    out = {}
    if frames:
        f = frames[-1]
        out["raised_at"] = f"{_short(f.filename)}:{f.lineno} in {f.name}"
    ours = [f for f in frames if f"{os.sep}hf_megatrain{os.sep}" in f.filename]
    if ours:
        f = ours[-1]
        out["hf_megatrain_frame"] = f"{_short(f.filename)}:{f.lineno} in {f.name}"
    return out


def _short(path: str) -> str:
    for marker in (f"{os.sep}hf_megatrain{os.sep}", f"{os.sep}site-packages{os.sep}", f"{os.sep}tests{os.sep}"):
        if marker in path:
            head = marker.strip(os.sep)
            return (head + os.sep if head != "site-packages" else "") + path.split(marker, 1)[1]
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    phase = {"outcome": rep.outcome}
    if call.excinfo is not None and rep.failed:
        exc = call.excinfo.value
        offline = _not_runnable_here(exc)
        if offline:
            rep.outcome = "skipped"
            rep.longrepr = (str(item.path), item.location[1] or 0, "Skipped: " + offline)
            phase = {"outcome": "skipped", "reason": offline}
        else:
            phase.update(reason=_one_line(exc), exc_type=f"{type(exc).__module__}.{type(exc).__name__}",
                         message_lines=len(str(exc).strip().splitlines()), **_where(call.excinfo.tb))
    elif rep.skipped:
        if hasattr(rep, "wasxfail"):
            phase = {"outcome": "xfailed", "reason": rep.wasxfail}
        else:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            phase["reason"] = reason.removeprefix("Skipped: ")
    if _current is not None:
        _current["phases"][call.when] = phase


def _finish(rec: dict) -> None:
    phases = rec["phases"]
    outcomes = {p["outcome"] for p in phases.values()}
    if phases.get("setup", {}).get("outcome") == "failed":
        state, src = "error", phases["setup"]
    elif phases.get("call", {}).get("outcome") == "failed":
        state, src = "failed", phases["call"]
    elif "skipped" in outcomes or "xfailed" in outcomes:
        src = next(p for p in phases.values() if p["outcome"] in ("skipped", "xfailed"))
        state = src["outcome"]
    elif phases.get("teardown", {}).get("outcome") == "failed":
        state, src = "error", phases["teardown"]
    else:
        state, src = "passed", {}
    line = {"nodeid": rec["nodeid"], "outcome": state, "seconds": round(time.time() - rec["start"], 2),
            "kinds": sorted(rec["kinds"]), **({"unswapped": sorted(rec["unswapped"])} if rec["unswapped"] else {}),
            **{k: v for k, v in src.items() if k != "outcome"}}
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps(line) + "\n")
