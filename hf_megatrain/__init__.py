"""hf_megatrain: train HF decoder LLMs larger than GPU memory on one GPU, through Trainer."""

from .arguments import MegaTrainArguments
from .engine.optimizer import HostAdamW
from .engine.schedule import StreamingEngine
from .errors import HostJobError, MegaTrainError
from .loop import prepare
from .patcher.specs import supported_model_types
from .trainer import MegaTrainTrainer

__all__ = [
    "HostAdamW",
    "HostJobError",
    "MegaTrainArguments",
    "MegaTrainError",
    "MegaTrainTrainer",
    "StreamingEngine",
    "prepare",
    "supported_model_types",
]
__version__ = "0.1.0"
