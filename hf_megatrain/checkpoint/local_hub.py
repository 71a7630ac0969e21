"""Publish into a local hub: the standard HF hub-cache layout, never the network.

    <hub>/models--org--name/blobs/<sha256>                          file contents, content-addressed
    <hub>/models--org--name/snapshots/<commit>/<path> -> ../../blobs/<sha256>   relative links
    <hub>/models--org--name/refs/main                               the current commit, rewritten atomically

With HF_HUB_CACHE=<hub> and HF_HUB_OFFLINE=1, `from_pretrained("org/name")` loads the newest
commit and `revision=<commit>` an older one. A commit is like `upload_folder`: the previous
snapshot's files plus the uploaded ones. Snapshots are built in a temporary folder and renamed
into place; `refs/main` moves only after that, so a crash never leaves a half-published model.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import time

from ..errors import MegaTrainError

_CHUNK = 16 << 20


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LocalHub:
    def __init__(self, root: str, repo_id: str):
        if not repo_id or repo_id.startswith("/") or ".." in repo_id.split("/"):
            raise MegaTrainError(f"invalid hub_model_id {repo_id!r}; use 'org/name' or 'name'.")
        self.root = os.path.abspath(root)
        self.repo_id = repo_id
        self.repo = os.path.join(self.root, "models--" + repo_id.replace("/", "--"))
        for sub in ("blobs", "snapshots", "refs"):
            os.makedirs(os.path.join(self.repo, sub), exist_ok=True)

    # -- reading ---------------------------------------------------------------------------------
    def head(self, ref: str = "main") -> str | None:
        try:
            with open(os.path.join(self.repo, "refs", ref)) as f:
                return f.read().strip() or None
        except FileNotFoundError:
            return None

    def files(self, commit: str | None) -> dict[str, str]:
        """path in repo -> blob sha256, for a commit."""
        if commit is None:
            return {}
        snap = os.path.join(self.repo, "snapshots", commit)
        out = {}
        for dirpath, _, names in os.walk(snap):
            for n in names:
                full = os.path.join(dirpath, n)
                out[os.path.relpath(full, snap)] = os.path.basename(os.readlink(full))
        return out

    # -- writing ---------------------------------------------------------------------------------
    def _add_blob(self, path: str) -> str:
        sha = _sha256(path)
        blob = os.path.join(self.repo, "blobs", sha)
        if not os.path.exists(blob):
            tmp = f"{blob}.incomplete-{os.getpid()}"
            shutil.copyfile(path, tmp)  # a copy: the source may later be rewritten in place
            os.replace(tmp, blob)
        return sha

    def commit(self, uploads: list[tuple[str, str]], message: str, ignore: tuple[str, ...] = ()) -> str:
        """uploads: (local folder, path in repo). Returns the new commit id."""
        parent = self.head()
        tree = self.files(parent)
        for folder, prefix in uploads:
            for dirpath, dirnames, names in os.walk(folder):
                rel_dir = os.path.relpath(dirpath, folder)
                dirnames[:] = [d for d in dirnames if not _ignored(os.path.normpath(os.path.join(rel_dir, d)), ignore)]
                for n in names:
                    rel = os.path.normpath(os.path.join(rel_dir, n))
                    if _ignored(rel, ignore):
                        continue
                    tree[os.path.normpath(os.path.join(prefix, rel))] = self._add_blob(os.path.join(dirpath, n))
        stamp = json.dumps({"parent": parent, "tree": sorted(tree.items()), "message": message, "t": time.time()})
        commit = hashlib.sha1(stamp.encode()).hexdigest()
        snap = os.path.join(self.repo, "snapshots", commit)
        tmp = os.path.join(self.repo, "snapshots", f".{commit}.tmp-{os.getpid()}")
        for rel, sha in tree.items():
            link = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            target = os.path.relpath(os.path.join(self.repo, "blobs", sha), os.path.dirname(os.path.join(snap, rel)))
            os.symlink(target, link)
        os.replace(tmp, snap)
        _write_atomic(os.path.join(self.repo, "refs", "main"), commit)
        return commit


# What a checkpoint holds beside the model to resume training from it: the optimizer state (fp32 masters
# and Adam moments, 12 bytes per parameter: 3x an fp32 model's files, 6x a bf16 one's), the scheduler,
# RNG states, the trainer's state and the manifest of them all. A published model leaves them out, as
# Trainer's own push of the model does.
TRAINING_STATE = ("megatrain_optimizer*", "megatrain_manifest.json", "optimizer.pt", "optimizer.bin", "scheduler.pt",
                  "scaler.pt", "rng_state*.pth", "trainer_state.json")


def training_state_files(folder: str) -> list[str]:
    """The files of `folder` (top level) that TRAINING_STATE names."""
    return sorted(n for n in os.listdir(folder)
                  if os.path.isfile(os.path.join(folder, n)) and any(fnmatch.fnmatch(n, p) for p in TRAINING_STATE))


def _ignored(rel: str, patterns: tuple[str, ...]) -> bool:
    first = rel.split(os.sep)[0]
    return any(fnmatch.fnmatch(first, p) or fnmatch.fnmatch(rel, p) for p in patterns)


def default_hub_dir(hub_dir: str | None) -> str:
    """The local hub folder to publish into: `hub_dir`, else $HF_HUB_CACHE; refused if neither."""
    hub = hub_dir or os.environ.get("HF_HUB_CACHE")
    if not hub:
        raise MegaTrainError(
            "push_to_hub publishes into a local hub directory and never uploads: set hub_dir= "
            "(or the HF_HUB_CACHE environment variable) to the hub cache folder to publish into."
        )
    return hub
