"""Data: tokenizers (and, in later issues, datasets and synthetic tasks)."""
from .tokenizers import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "load_tokenizer"]
