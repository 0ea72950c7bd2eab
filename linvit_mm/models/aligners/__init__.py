"""The alignment stages of the staged recipe, as mmpretrain models (``mode='loss'`` returns
the alignment losses): a student LinearViT against a frozen Softmax teacher, no labels."""
from .attention_aligner import AttentionAligner
from .base_aligner import BaseAligner
from .feature_aligner import FeatureAligner

__all__ = ['AttentionAligner', 'BaseAligner', 'FeatureAligner']
