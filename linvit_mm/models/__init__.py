"""Models, registered in mmpretrain's MODELS on import (``custom_imports``)."""
from .attention import ATTENTIONS, BaseAttention, build_attention
from .adapters import LinearViTAdapter, LinearViTPlainPyramid
from .aligners import AttentionAligner, FeatureAligner
from .backbones import LinearViT

__all__ = ['ATTENTIONS', 'AttentionAligner', 'BaseAttention', 'FeatureAligner', 'LinearViT',
           'LinearViTAdapter', 'LinearViTPlainPyramid', 'build_attention']
