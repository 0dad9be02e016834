"""Dense text encoders: presets (MiniLM default, Contriever, Stella, GTE) and any local HF folder."""

from rmm.encoders.encoder import DenseHead, Encoder, EncoderConfig
from rmm.encoders.pooling import POOLING_MODES, EncoderError, pool
from rmm.encoders.presets import DEFAULT_ENCODER, PRESETS, Preset, load_encoder

__all__ = [
    "DEFAULT_ENCODER",
    "POOLING_MODES",
    "PRESETS",
    "DenseHead",
    "Encoder",
    "EncoderConfig",
    "EncoderError",
    "Preset",
    "load_encoder",
    "pool",
]
