"""Synthesized Hugging Face checkpoints for tests and demos: real file formats, generated content."""
