"""Softmax-to-linear weight transfer: checkpoint readers and initialisation settings."""
from .checkpoint import KNOWN_FORMATS, SoftmaxCheckpoint, load_softmax_checkpoint

__all__ = ['KNOWN_FORMATS', 'SoftmaxCheckpoint', 'load_softmax_checkpoint']
