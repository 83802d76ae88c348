"""Equinox layers running on attnaux backends."""

from ._attention import MultiheadAttention as MultiheadAttention
from ._decoder import Decoder as Decoder
from ._decoder import DecoderBlock as DecoderBlock

__all__ = ["Decoder", "DecoderBlock", "MultiheadAttention"]
