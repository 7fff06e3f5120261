"""MuseTalk v1.5 networks: definitions from diffusers/transformers, upstream checkpoint loading,
and a seeded random-weight fallback."""

from lipstream.models.config import PRESETS, ModelConfig, preset
from lipstream.models.load import COMPONENTS, RANDOM_WARNING, MuseTalk, default_dtype, load_musetalk
from lipstream.models.positional import PositionalEncoding

__all__ = ["COMPONENTS", "PRESETS", "RANDOM_WARNING", "ModelConfig", "MuseTalk", "PositionalEncoding",
           "default_dtype", "load_musetalk", "preset"]
