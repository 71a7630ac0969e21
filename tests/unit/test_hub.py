"""Hub ids resolve as `from_pretrained` resolves them: the local HF cache first, then a download
through huggingface_hub, unless HF_HUB_OFFLINE=1. There is no network here: the cache is a local
hub folder in the standard layout, and the download function is replaced by one that records
what it was asked for (the cached lookups still run through the real huggingface_hub)."""

import shutil

import huggingface_hub
import huggingface_hub.constants
import pytest

from hf_megatrain import MegaTrainArguments, MegaTrainError, MegaTrainTrainer
from hf_megatrain.checkpoint.local_hub import LocalHub
from hf_megatrain.checkpoint.stream_load import MODEL_FILES, resolve_folder
from hf_megatrain.cli import main
from tests.support.tiny import make_model


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty local hub cache that huggingface_hub uses, and a saved tiny model to publish in it."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    folder = tmp_path / "tiny"
    make_model("llama").save_pretrained(folder)
    return cache, folder


@pytest.fixture
def downloads(monkeypatch, hub):
    """The network: records each non-cached snapshot_download and serves the saved tiny model."""
    calls = []
    real = huggingface_hub.snapshot_download

    def snapshot_download(repo_id, *, local_files_only=False, allow_patterns=None, **kw):
        if local_files_only:
            return real(repo_id, local_files_only=True, allow_patterns=allow_patterns, **kw)
        calls.append((repo_id, allow_patterns))
        if repo_id == "org/missing":
            raise ConnectionError("Failed to resolve 'huggingface.co'")  # what no network looks like
        LocalHub(str(hub[0]), repo_id).commit([(str(hub[1]), "")], "downloaded")
        return real(repo_id, local_files_only=True, allow_patterns=allow_patterns, **kw)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return calls


def test_a_cached_hub_id_never_downloads(hub, downloads):
    LocalHub(str(hub[0]), "org/tiny").commit([(str(hub[1]), "")], "cached")
    folder = resolve_folder("org/tiny")
    assert downloads == [] and (hub[0] / "models--org--tiny").as_posix() in folder


def test_an_uncached_hub_id_downloads_the_model_files_only(hub, downloads):
    folder = resolve_folder("org/tiny")
    assert downloads == [("org/tiny", MODEL_FILES)]  # configs, safetensors, tokenizer: no .bin, no .gguf
    assert any(n.endswith(".safetensors") for n in __import__("os").listdir(folder))


def test_a_config_only_snapshot_downloads_the_weights_when_training(hub, downloads):
    partial = hub[1].parent / "config_only"
    partial.mkdir()
    shutil.copy(hub[1] / "config.json", partial / "config.json")
    LocalHub(str(hub[0]), "org/tiny").commit([(str(partial), "")], "what estimate fetched")
    assert resolve_folder("org/tiny", files=["config.json"])  # enough for estimate, from the cache
    assert downloads == []
    resolve_folder("org/tiny")  # training needs the weights: now it downloads
    assert downloads == [("org/tiny", MODEL_FILES)]


def test_estimate_of_an_uncached_hub_id_fetches_only_its_config(hub, downloads, capsys):
    assert main(["estimate", "org/tiny", "--batch", "1", "--seq", "16"]) == 0
    assert downloads == [("org/tiny", ["config.json"])]
    assert "org/tiny" in capsys.readouterr().out


def test_a_failed_download_names_the_hf_command(hub, downloads):
    with pytest.raises(MegaTrainError, match=r"could not be downloaded .*ConnectionError.*`hf download "
                                             r"org/missing`"):
        resolve_folder("org/missing")


def test_offline_refuses_to_download_and_says_how(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = MegaTrainArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    with pytest.raises(MegaTrainError) as info:
        MegaTrainTrainer("org/absent", args)
    text = str(info.value)
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in text and "`hf download org/absent`" in text
    assert "huggingface-cli" not in text
