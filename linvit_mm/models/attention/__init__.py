"""Attention operators behind one interface; ``build_attention(name, ...)`` picks one."""
from .base import ATTENTIONS, BaseAttention, attention_class, build_attention, register_attention

__all__ = ['ATTENTIONS', 'BaseAttention', 'attention_class', 'build_attention',
           'register_attention']
