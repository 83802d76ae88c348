"""Equinox layers running on attnaux backends."""

from ._attention import MultiheadAttention as MultiheadAttention

__all__ = ["MultiheadAttention"]
