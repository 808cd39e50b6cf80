"""trl-qerl: QeRL (quantisation-enhanced RL) for the Hugging Face stack.

NVFP4 4-bit base weights + LoRA + Adaptive Quantization Noise, trained with TRL's GRPO/DAPO::

    from trl_qerl import QeRLConfig, QeRLGRPOTrainer
    trainer = QeRLGRPOTrainer(model="Qwen/Qwen2.5-7B-Instruct", reward_funcs=[...],
                              args=QeRLConfig(output_dir="out"), train_dataset=dataset)

Importing the package registers the NVFP4 quantizer with transformers; the trainer and its dependencies (TRL,
PEFT) load on first use. A model loaded with `NVFP4A16Config` (or `from_pretrained`) takes LoRA through plain PEFT
(``peft.get_peft_model``, ``PeftModel.from_pretrained``) and TRL (``GRPOTrainer(..., peft_config=LoraConfig(...))``)
with nothing else from this package.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .loading import from_pretrained
from .nvfp4._deprecation import deprecated_names
from .nvfp4.linear import NVFP4A16Linear, NVFP4WeightError
from .quantizer import NVFP4A16Config, NVFP4A16HfQuantizer, quantize_model


__version__ = "0.1.0.dev0"

_LAZY = {
    "QeRLConfig": ".config",
    "QeRLGRPOTrainer": ".trainer",
    "AQNCallback": ".noise",
    "NoiseSchedule": ".noise",
    "get_peft_model": ".lora",
    "load_adapter": ".lora",
    "merge_and_export": ".lora",
    "nvfp4_lora_config": ".lora",
    "accuracy_reward": ".rewards",
    "format_reward": ".rewards",
    "build_math_dataset": ".data",
}

if TYPE_CHECKING:
    from .config import QeRLConfig
    from .data import build_math_dataset
    from .lora import get_peft_model, load_adapter, merge_and_export, nvfp4_lora_config
    from .noise import AQNCallback, NoiseSchedule
    from .rewards import accuracy_reward, format_reward
    from .trainer import QeRLGRPOTrainer


# Deprecated for one release: transformers exports unrelated classes with these names (W4A4 NVFP4 for Blackwell).
_deprecated = deprecated_names(
    __name__,
    {"NVFP4Config": "NVFP4A16Config", "NVFP4HfQuantizer": "NVFP4A16HfQuantizer", "NVFP4Linear": "NVFP4A16Linear"},
    lambda name: globals()[name],
)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    return _deprecated(name)  # a renamed class with a FutureWarning, else AttributeError


__all__ = [
    "NVFP4A16Config",
    "NVFP4A16HfQuantizer",
    "NVFP4A16Linear",
    "NVFP4WeightError",
    "from_pretrained",
    "quantize_model",
    "__version__",
    # loaded on first use (_LAZY)
    "AQNCallback",
    "NoiseSchedule",
    "QeRLConfig",
    "QeRLGRPOTrainer",
    "accuracy_reward",
    "build_math_dataset",
    "format_reward",
    "get_peft_model",
    "load_adapter",
    "merge_and_export",
    "nvfp4_lora_config",
]
