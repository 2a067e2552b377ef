"""Models used by the demo, benchmarks and recipes."""

from .decoder_lm import Block, DecoderLM, DecoderLMConfig

__all__ = ["Block", "DecoderLM", "DecoderLMConfig"]
