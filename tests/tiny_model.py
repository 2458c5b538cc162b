"""Moved to tests/support/tiny_model.py. This module stays while bench/ still imports
`tests.tiny_model`; remove it once bench/ imports tests.support.tiny_model."""

from tests.support.tiny_model import WORDS, make_tiny_model

__all__ = ["WORDS", "make_tiny_model"]
