"""Reference models built from opforge layers (each also buildable from torch.nn, for comparison)."""
from .llama import BACKENDS, Llama, LlamaConfig

__all__ = ["BACKENDS", "Llama", "LlamaConfig"]
