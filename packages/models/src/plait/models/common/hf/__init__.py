"""Hugging Face conversion shared by every family: config.json parsing, checkpoint load/export."""
