"""Models, registered in mmpretrain's MODELS on import (``custom_imports``)."""
from .attention import ATTENTIONS, BaseAttention, build_attention
from .adapters import LinearViTAdapter
from .backbones import LinearViT

__all__ = ['ATTENTIONS', 'BaseAttention', 'LinearViT', 'LinearViTAdapter', 'build_attention']
