"""Building blocks of the backbones that are not attention operators."""
from .rope import GridRotation, RotaryPositionEmbedding2D, build_rope

__all__ = ['GridRotation', 'RotaryPositionEmbedding2D', 'build_rope']
