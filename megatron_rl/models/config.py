"""Model selection for a recipe (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    """Which model to train and how to run it.

    ``preset`` names a built-in architecture (``llama3-8b``, ``llama4-scout``, ``tiny-llama``,
    ``tiny-llama4``); ``hf_path`` points to a Hugging Face model directory (config.json, and
    weights to start from). With both, the HF directory's config wins and ``preset`` is ignored.
    """

    preset: str | None = None
    hf_path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # ScaleRL: compute the LM head (logits, log-probs) in FP32 even in a BF16 model.
    fp32_head: bool = True
    # GPU only: Transformer Engine FP8 recipe for the linear layers.
    fp8: Literal["e4m3", "hybrid"] | None = None
    # "auto": Transformer Engine specs on GPU (an error if TE does not import there), local
    # specs with torch SDPA on CPU; "local" on GPU runs without TE (no FP8).
    layer_spec: Literal["auto", "te", "local"] = "auto"
    recompute_activations: bool = False
    max_sequence_length: int | None = None  # default: the HF config's max_position_embeddings

    def validate(self) -> None:
        if self.preset is None and self.hf_path is None:
            raise ValueError("set either 'preset' or 'hf_path'")
        if self.fp8 is not None and self.dtype != "bfloat16":
            raise ValueError("fp8 needs dtype: bfloat16")
        if self.max_sequence_length is not None and self.max_sequence_length < 1:
            raise ValueError("max_sequence_length must be >= 1")
