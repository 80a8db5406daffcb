"""Hugging Face conversion: config.json <-> plait config, checkpoint mappers, load/export."""

from plait.models.hf.config import config_from_hf, config_to_hf, load_hf_config, save_hf_config
from plait.models.hf.io import from_pretrained, load_hf_checkpoint, save_hf_checkpoint
from plait.models.hf.mappers import hf_to_plait_mapper, plait_to_hf_mapper

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "hf_to_plait_mapper",
    "load_hf_checkpoint",
    "load_hf_config",
    "plait_to_hf_mapper",
    "save_hf_checkpoint",
    "save_hf_config",
]
