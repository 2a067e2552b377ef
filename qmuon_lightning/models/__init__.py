"""Models used by the demo, benchmarks and recipes."""

from .decoder_lm import Block, DecoderLM, DecoderLMConfig, mean_window_loss
from .lm_module import DecoderLMModule, MuonWithAdamW, OptimizerSpec

__all__ = ["Block", "DecoderLM", "DecoderLMConfig", "DecoderLMModule", "MuonWithAdamW", "OptimizerSpec", "mean_window_loss"]
