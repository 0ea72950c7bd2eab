"""Attention operators behind one interface; ``build_attention(name, ...)`` picks one."""
from .base import (ATTENTIONS, LEADING_ROWS, OWN_INIT, SOFTMAX_FILLS, WHOLE, BaseAttention,
                   attention_class, attention_types, build_attention, register_attention)
from .hedgehog import HedgehogAttention
from .inline import InLineAttention
from .kernel import ELUAttention, KernelAttention, ReLUAttention
from .map_attention import LinearMapAttention
from .mhla import MultiHeadLinearAttention
from .softmax import SoftmaxAttention
from .ttt import TTTAttention

__all__ = ['ATTENTIONS', 'BaseAttention', 'attention_class', 'attention_types', 'build_attention',
           'register_attention', 'LEADING_ROWS', 'OWN_INIT', 'SOFTMAX_FILLS', 'WHOLE']
__all__ += ['ELUAttention', 'HedgehogAttention', 'InLineAttention', 'KernelAttention',
            'LinearMapAttention', 'MultiHeadLinearAttention', 'ReLUAttention', 'SoftmaxAttention',
            'TTTAttention']
