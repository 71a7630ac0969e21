"""Offline stand-ins for the hub fixtures that TRL's SFT, DPO, KTO, ORPO and CPO tests load.

`build(root)` writes, under `root`:

* `hub/`: a Hugging Face hub cache (`models--org--name/snapshots/<rev>/`, `refs/main`) holding a tiny
  random model for every model id the tests name (same model class as the real tiny model, hidden 64,
  2 layers, stored in bf16 as the real ones are), each with a tokenizer built here: a byte-level BPE
  trained on the fixture text, the model's special tokens and the chat template that TRL ships for that
  family (read from the installed trl package). `Qwen/Qwen3-4B` is there as a config and tokenizer only (a
  chat-template source for `chat_template_path`), `tiny-RemoteForCausalLM` as custom code.
  `tiny-T5ForConditionalGeneration` (the encoder-decoder that the ORPO and CPO tests load in every
  `setup_method`) is flan-t5-small's architecture at hidden 64, stored in fp32 as the real one is, with
  no chat template and a tokenizer that ends each text with `</s>` as T5's does.
* `datasets/<org>/<name>/<config>/<split>.parquet`: the `zen`, `harmony` and `toolcall` configs that the
  SFT, DPO, KTO, ORPO and CPO tests load (language modeling, prompt-completion, paired and unpaired
  preference), with the real columns and split sizes (train 17 / test 2 for zen), rows generated here: a
  pair's rejected completion is another row's, shifted by OTHER rows (in `standard_implicit_prompt_preference`
  the first from there on that shares only whole words with the chosen one).

With `HF_HUB_CACHE=<root>/hub` and `HF_HUB_OFFLINE=1`, `from_pretrained` of those ids works offline for
stock TRL and for the engine alike; the plugin points `load_dataset` at the parquet files.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ORG = "trl-internal-testing"
HIDDEN = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
SEQ2SEQ = dict(d_model=64, d_kv=16, d_ff=128, num_heads=4, num_layers=2, num_decoder_layers=2,
               feed_forward_proj="gated-gelu", tie_word_embeddings=False)  # flan-t5-small's, scaled down
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)  # MoE intermediate >= 64 (transformers 5.17 grouped mm)
TOKEN_PATTERNS = r"<\|[^|<>\s]+\|>|</?(?:think|tool_call|tool_response|tools|arg_key|arg_value)>|\[gMASK\]|<sop>"

# A plain ChatML template for the one family (OLMo 3) whose template TRL does not ship.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class Spec:
    """One hub model: its model type, config beyond HIDDEN, chat template (a file name of
    trl/chat_templates, CHATML or None) and special tokens."""

    model_type: str
    template: str | None
    eos: str
    pad: str | None = None
    bos: str | None = None
    config: dict = field(default_factory=dict)
    dtype: str = "bfloat16"
    eos_extra: tuple = ()  # further end tokens in the config's eos_token_id list
    weights: bool = True  # False: a config and a tokenizer only


MODELS = {
    f"{ORG}/tiny-Qwen2ForCausalLM-2.5": Spec("qwen2", "qwen2_5", "<|im_end|>", "<|endoftext|>"),
    f"{ORG}/tiny-Qwen3ForCausalLM": Spec("qwen3", "qwen3", "<|im_end|>", "<|endoftext|>", config=dict(head_dim=16)),
    f"{ORG}/tiny-Qwen3MoeForCausalLM": Spec("qwen3_moe", "qwen3", "<|im_end|>", "<|endoftext|>",
                                            config=dict(MOE, head_dim=16, num_experts=4)),
    f"{ORG}/tiny-Cohere2ForCausalLM": Spec("cohere2", "cohere2", "<|END_OF_TURN_TOKEN|>", "<PAD>", "<BOS_TOKEN>",
                                           config=dict(head_dim=16, layer_types=["sliding_attention", "full_attention"])),
    f"{ORG}/tiny-Glm4MoeForCausalLM": Spec("glm4_moe", "glm4moe", "<|endoftext|>", "<|endoftext|>",
                                           config=dict(MOE, head_dim=16, n_routed_experts=4, first_k_dense_replace=1),
                                           eos_extra=("<|user|>", "<|observation|>")),
    f"{ORG}/tiny-GptOssForCausalLM": Spec("gpt_oss", "gptoss", "<|return|>", "<|endoftext|>",
                                          config=dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                      intermediate_size=64)),
    f"{ORG}/tiny-NemotronHForCausalLM-nano": Spec(
        "nemotron_h", "nemotron_3_nano", "<|im_end|>", "<|endoftext|>", "<s>",
        config=dict(MOE, head_dim=16, layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=8,
                    mamba_head_dim=16, mamba_n_groups=1, ssm_state_size=16, n_routed_experts=4,
                    moe_shared_expert_intermediate_size=64, use_mamba_kernels=False)),
    f"{ORG}/tiny-Olmo3ForCausalLM": Spec("olmo3", "CHATML", "<|endoftext|>", "<|pad|>"),
    f"{ORG}/tiny-Lfm2ForCausalLM": Spec("lfm2", "lfm2", "<|im_end|>", "<|pad|>", "<|startoftext|>",
                                        config=dict(layer_types=["conv", "full_attention"], block_multiple_of=8,
                                                    conv_L_cache=3)),
    f"{ORG}/tiny-Lfm2ForCausalLM-2.5": Spec("lfm2", "lfm2_2_5", "<|im_end|>", "<|pad|>", "<|startoftext|>",
                                            config=dict(layer_types=["conv", "full_attention"],
                                                        block_auto_adjust_ff_dim=False, conv_L_cache=3)),
    f"{ORG}/tiny-GPTNeoXForCausalLM": Spec("gpt_neox", None, "<|endoftext|>", None, "<|endoftext|>", dtype="float16"),
    f"{ORG}/tiny-RemoteForCausalLM": Spec("remote", "llama3_2", "<|eot_id|>", None, "<|begin_of_text|>"),
    f"{ORG}/tiny-T5ForConditionalGeneration": Spec("t5", None, "</s>", "<pad>", dtype="float32"),
    "Qwen/Qwen3-4B": Spec("qwen3", "qwen3", "<|im_end|>", "<|endoftext|>", weights=False),
}

# Custom code for tiny-RemoteForCausalLM: a Llama under another name, loadable only with trust_remote_code.
REMOTE_CONFIG = '''from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
'''
REMOTE_MODELING = '''from transformers import LlamaForCausalLM, LlamaModel

from .configuration_remote import RemoteConfig


class RemoteModel(LlamaModel):
    config_class = RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
'''


# ---------------------------------------------------------------------------------------------- data

def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # prints the poem on import

        return [line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line]


def split_line(line: str) -> tuple[str, str]:
    """A prompt (the first half of the words) and its completion (the rest, with its leading space)."""
    words = line.split(" ")  # every line has two words or more
    k = max(1, len(words) // 2)
    return " ".join(words[:k]), " " + " ".join(words[k:])


def question(line: str) -> tuple[str, str]:
    prompt, completion = split_line(line)
    return f"How does the line of the Zen of Python that starts with '{prompt}' go on?", completion.strip()


EFFORTS = ["low", "medium", "high"]
OTHER = 7  # a preference row's rejected completion is the completion of the row OTHER rows on
IDENTITY = "You are a tiny test model."


def tool_functions():
    """Made-up tools (their JSON schemas come from the signatures and docstrings)."""

    def convert_currency(amount: float, target: str) -> float:
        """
        Converts an amount of euros into another currency.

        Args:
            amount: The amount in euros.
            target: The ISO code of the target currency.
        """
        return amount

    def get_stock_price(symbol: str) -> float:
        """
        Returns the last price of a stock.

        Args:
            symbol: The ticker symbol.
        """
        return 1.0

    def roll_dice(sides: int) -> int:
        """
        Rolls one die.

        Args:
            sides: The number of sides of the die.
        """
        return 1

    def set_alarm(time: str, label: str) -> str:
        """
        Sets an alarm.

        Args:
            time: The time of the alarm, as HH:MM.
            label: What the alarm is for.
        """
        return time

    return {f.__name__: f for f in (convert_currency, get_stock_price, roll_dice, set_alarm)}


TOOL_ROWS = [  # (user, tool, arguments, tool result, answer, tools offered)
    ("How much is 20 euros in dollars?", "convert_currency", {"amount": 20.0, "target": "USD"}, "21.7",
     "20 euros are about 21.70 dollars.", ["convert_currency", "get_stock_price"]),
    ("What is the price of ACME shares?", "get_stock_price", {"symbol": "ACME"}, "132.5",
     "ACME trades at 132.50.", ["get_stock_price"]),
    ("Roll a die for me.", "roll_dice", {"sides": 6}, "4", "You rolled a 4.", ["roll_dice", "set_alarm"]),
    ("Wake me up at seven.", "set_alarm", {"time": "07:00", "label": "wake up"}, "07:00",
     "Your alarm is set for 07:00.", ["set_alarm"]),
    ("Convert 5 euros to yen.", "convert_currency", {"amount": 5.0, "target": "JPY"}, "845",
     "5 euros are about 845 yen.", ["convert_currency"]),
    ("Roll a twenty-sided die.", "roll_dice", {"sides": 20}, "17", "It landed on 17.", ["roll_dice"]),
    ("Remind me of the meeting at 14:30.", "set_alarm", {"time": "14:30", "label": "meeting"}, "14:30",
     "I set an alarm for the meeting at 14:30.", ["set_alarm", "roll_dice"]),
    ("How is BOLT stock doing?", "get_stock_price", {"symbol": "BOLT"}, "8.1", "BOLT is at 8.10.",
     ["get_stock_price", "convert_currency"]),
    ("What are 100 euros in pounds?", "convert_currency", {"amount": 100.0, "target": "GBP"}, "85.2",
     "100 euros are about 85 pounds.", ["convert_currency"]),
    ("Throw a die with 12 sides.", "roll_dice", {"sides": 12}, "9", "You got a 9.", ["roll_dice"]),
]


def dataset_rows() -> dict[tuple[str, str], list[dict]]:
    """(repo id, config) -> rows, in order (the last 10% of rows become the test split)."""
    from transformers.utils import get_json_schema

    lines = zen_lines()
    halves = [split_line(line) for line in lines]
    qa = [question(line) for line in lines]
    zen, harmony, toolcall = f"{ORG}/zen", f"{ORG}/harmony", f"{ORG}/toolcall"
    user = [{"role": "user", "content": q} for q, _ in qa]
    answer = [{"role": "assistant", "content": a} for _, a in qa]
    thinking = [dict(a, thinking=f"The line begins with '{p}'.") for a, (p, _) in zip(answer, halves)]
    kwargs = [{"reasoning_effort": EFFORTS[i % 3], "model_identity": IDENTITY} for i in range(len(lines))]
    schemas = {name: get_json_schema(f) for name, f in tool_functions().items()}
    n = len(lines)
    other = [(i + OTHER) % n for i in range(n)]  # the row whose completion is this row's rejected one
    # Implicit-prompt pairs: the prompt is what chosen and rejected share (trl's extract_prompt), which in TRL's
    # rows ends at a word. From OTHER rows on, the first completion that shares whole words only, so that it does
    # here too (" explicitly" against " explain" would cut the prompt mid-word, and ORPO's and CPO's tokenize_row
    # refuse such a pair: "Chosen and rejected prompt_input_ids might only differ on the last token ...").
    implicit = [next(k % n for k in range(i + OTHER, i + OTHER + n) if whole_words(halves[i][1], halves[k % n][1]))
                for i in range(n)]
    desirable = [i % 2 == 0 for i in range(n)]  # unpaired rows: own completion (True) or another's (False)
    rows = {
        (zen, "standard_language_modeling"): [{"text": line} for line in lines],
        (zen, "standard_prompt_completion"): [{"prompt": p, "completion": c} for p, c in halves],

        (zen, "conversational_language_modeling"): [{"messages": [u, a]} for u, a in zip(user, answer)],
        (zen, "conversational_prompt_completion"): [{"prompt": [u], "completion": [a]} for u, a in zip(user, answer)],
        (harmony, "language_modeling"): [{"messages": [u, t], "chat_template_kwargs": k}
                                         for u, t, k in zip(user, thinking, kwargs)],
        (harmony, "prompt_completion"): [{"prompt": [u], "completion": [t], "chat_template_kwargs": k}
                                         for u, t, k in zip(user, thinking, kwargs)],
        (toolcall, "language_modeling"): [
            {"messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": f, "arguments": a}}]},
                {"role": "tool", "name": f, "content": r},
                {"role": "assistant", "content": ans}],
             "tools": json.dumps([schemas[n] for n in offered])}
            for q, f, a, r, ans, offered in TOOL_ROWS],
        # preference data (DPO, KTO)
        (zen, "standard_preference"): [{"prompt": p, "chosen": c, "rejected": halves[j][1]}
                                       for (p, c), j in zip(halves, other)],
        (zen, "standard_implicit_prompt_preference"): [{"chosen": p + c, "rejected": p + halves[j][1]}
                                                       for (p, c), j in zip(halves, implicit)],
        (zen, "standard_unpaired_preference"): [{"prompt": p, "completion": c if d else halves[j][1], "label": d}
                                                for (p, c), j, d in zip(halves, other, desirable)],
        (zen, "conversational_preference"): [{"prompt": [u], "chosen": [a], "rejected": [answer[j]]}
                                             for u, a, j in zip(user, answer, other)],
        (zen, "conversational_implicit_prompt_preference"): [{"chosen": [u, a], "rejected": [u, answer[j]]}
                                                             for u, a, j in zip(user, answer, other)],
        (harmony, "preference"): [{"prompt": [u], "chosen": [t], "rejected": [thinking[j]], "chat_template_kwargs": k}
                                  for u, t, j, k in zip(user, thinking, other, kwargs)],
        (toolcall, "preference"): [
            {"prompt": [{"role": "user", "content": q}],
             "chosen": tool_turns(f, a, r, ans),
             "rejected": (tool_turns(f, a, r, TOOL_ROWS[(i + 1) % len(TOOL_ROWS)][4]) if i % 2  # a wrong reply
                          else [{"role": "assistant", "content": TOOL_ROWS[(i + 1) % len(TOOL_ROWS)][4]}]),  # no call
             "tools": json.dumps([schemas[n] for n in offered])}
            for i, (q, f, a, r, ans, offered) in enumerate(TOOL_ROWS)],
    }
    return rows


def whole_words(a: str, b: str) -> bool:
    """Whether what two completions (each with its leading space) share ends at a word: the last character
    they have in common is a space."""
    shared = os.path.commonprefix([a, b])
    return shared.endswith(" ") and shared not in (a, b)


def tool_turns(tool: str, arguments: dict, result: str, answer: str) -> list[dict]:
    """An assistant's tool call, the tool's answer and the assistant's reply."""
    call = {"type": "function", "function": {"name": tool, "arguments": arguments}}
    return [{"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "name": tool, "content": result},
            {"role": "assistant", "content": answer}]


def write_datasets(folder: Path) -> None:
    from datasets import Dataset

    for (repo, config), rows in dataset_rows().items():
        n_train = len(rows) - max(1, round(len(rows) * 0.1))  # as train_test_split(test_size=0.1, shuffle=False)
        out = folder / repo / config
        out.mkdir(parents=True)
        whole = Dataset.from_list(rows)  # one schema for both splits (tool arguments differ from row to row)
        whole.select(range(n_train)).to_parquet(str(out / "train.parquet"))
        whole.select(range(n_train, len(rows))).to_parquet(str(out / "test.parquet"))


def dataset_folder(root: str | Path, repo: str, config: str | None) -> Path | None:
    """The folder of a fixture dataset config (None when it is not one of ours)."""
    folder = Path(root) / "datasets" / repo / (config or "")
    return folder if config and folder.is_dir() else None


# ---------------------------------------------------------------------------------------------- models

def template_text(name: str | None) -> str | None:
    if name is None or name == "CHATML":
        return CHATML if name else None
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def train_bpe(corpus: list[str]):
    """A byte-level BPE (any text encodes) whose merges come from the fixture text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def make_tokenizer(bpe_json: str, spec: Spec):
    import re

    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    template = template_text(spec.template)
    specials = {t for t in (spec.bos, spec.eos, spec.pad, *spec.eos_extra) if t}
    specials |= set(re.findall(TOKEN_PATTERNS, template or ""))
    tok = Tokenizer.from_str(bpe_json)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(specials)])
    if spec.model_type == "t5":  # T5's tokenizer appends its EOS to every text
        from tokenizers.processors import TemplateProcessing

        eos = (spec.eos, tok.token_to_id(spec.eos))
        tok.post_processor = TemplateProcessing(single=f"$A {spec.eos}", pair=f"$A {spec.eos} $B {spec.eos}",
                                                special_tokens=[eos])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad)
    fast.model_max_length = 32768
    if template:
        fast.chat_template = template
    return fast


def make_model(spec: Spec, tokenizer, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids(spec.eos),
               bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    if spec.eos_extra:
        ids["eos_token_id"] = [ids["eos_token_id"], *tokenizer.convert_tokens_to_ids(list(spec.eos_extra))]
    kwargs = {**HIDDEN, **spec.config, **ids}
    if spec.model_type == "t5":  # an encoder-decoder: its own sizes, decoding starts at the pad token
        kwargs = {**SEQ2SEQ, **spec.config, **ids, "decoder_start_token_id": ids["pad_token_id"]}
    if spec.model_type == "nemotron_h":
        kwargs.pop("num_hidden_layers")  # its layers_block_type sets the depth
    config = AutoConfig.for_model("llama" if spec.model_type == "remote" else spec.model_type, **kwargs)
    torch.manual_seed(seed)
    model = (AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM).from_config(config)
    return model.to(getattr(torch, spec.dtype))


def write_remote(folder: Path) -> None:
    """Turn a saved Llama folder into the custom-code RemoteForCausalLM."""
    (folder / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote", architectures=["RemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                            "AutoModel": "modeling_remote.RemoteModel",
                            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def hub_snapshot(hub: Path, repo: str, kind: str = "models") -> Path:
    """An empty snapshot folder for `repo` in the hub-cache layout, its revision in refs/main."""
    base = hub / f"{kind}--{repo.replace('/', '--')}"
    rev = hashlib.sha1(f"peer-fixture:{repo}".encode()).hexdigest()
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(rev)
    snapshot = base / "snapshots" / rev
    snapshot.mkdir(parents=True)
    return snapshot


def write_models(hub: Path) -> None:
    rows = [json.dumps(r) for rs in dataset_rows().values() for r in rs]
    templates = [template_text(s.template) or "" for s in MODELS.values()]
    bpe_json = train_bpe(zen_lines() + rows + templates).to_str()
    for seed, (repo, spec) in enumerate(MODELS.items()):
        folder = hub_snapshot(hub, repo)
        tokenizer = make_tokenizer(bpe_json, spec)
        tokenizer.save_pretrained(folder)
        model = make_model(spec, tokenizer, seed)
        if not spec.weights:
            model.config.save_pretrained(folder)
            continue
        model.save_pretrained(folder)
        if spec.model_type == "remote":
            write_remote(folder)


# ---------------------------------------------------------------------------------------------- build

def stamp() -> str:
    """Changes whenever this file or the libraries that write the fixtures change."""
    import datasets
    import tokenizers
    import transformers
    import trl

    text = Path(__file__).read_text() + " ".join(
        m.__version__ for m in (transformers, tokenizers, datasets, trl))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build(root: str | Path) -> Path:
    """Build the fixtures under `root` unless an identical build is there; returns `root`."""
    root = Path(root)
    if (root / "STAMP").is_file() and (root / "STAMP").read_text() == stamp():
        return root
    tmp = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    write_datasets(tmp / "datasets")
    write_models(tmp / "hub")
    (tmp / "STAMP").write_text(stamp())
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/hf_megatrain_peer/fixtures"))
