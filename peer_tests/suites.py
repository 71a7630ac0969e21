"""The TRL test suites that run_trl.py runs (`--suite`), and the names the engine side swaps in each.

Each suite is one of TRL's test files, the test classes of it that are run, and the names that the plugin
(`--peer-engine`) rebinds in that test module: TRL's trainer and config, to hf_megatrain's classes
("module:attribute"). The file itself runs unmodified.
"""

from __future__ import annotations

from typing import NamedTuple


class Suite(NamedTuple):
    path: str  # the test file, relative to the TRL checkout
    classes: tuple[str, ...]  # its test classes that are run
    swap: dict[str, str]  # name in the test module -> "module:attribute" put there on the engine side

    def targets(self) -> list[str]:
        return [f"{self.path}::{c}" for c in self.classes]


SUITES = {
    "sft": Suite("tests/test_sft_trainer.py", ("TestSFTTrainer",),
                 {"SFTTrainer": "hf_megatrain.sft:MegaTrainSFTTrainer", "SFTConfig": "hf_megatrain.sft:MegaTrainSFTConfig"}),
    "dpo": Suite("tests/test_dpo_trainer.py", ("TestDPOTrainer",),
                 {"DPOTrainer": "hf_megatrain.dpo:MegaTrainDPOTrainer", "DPOConfig": "hf_megatrain.dpo:MegaTrainDPOConfig"}),
    "kto": Suite("tests/test_kto_trainer.py", ("TestKTOTrainer",),
                 {"KTOTrainer": "hf_megatrain.kto:MegaTrainKTOTrainer", "KTOConfig": "hf_megatrain.kto:MegaTrainKTOConfig"}),
    "orpo": Suite("tests/experimental/test_orpo_trainer.py", ("TestORPOTrainer",),
                  {"ORPOTrainer": "hf_megatrain.orpo:MegaTrainORPOTrainer",
                   "ORPOConfig": "hf_megatrain.orpo:MegaTrainORPOConfig"}),
    "cpo": Suite("tests/experimental/test_cpo_trainer.py", ("TestCPOTrainer",),
                 {"CPOTrainer": "hf_megatrain.cpo:MegaTrainCPOTrainer", "CPOConfig": "hf_megatrain.cpo:MegaTrainCPOConfig"}),
}
