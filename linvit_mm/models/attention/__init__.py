"""Attention operators behind one interface; ``build_attention(name, ...)`` picks one."""
from .base import ATTENTIONS, BaseAttention, attention_class, build_attention, register_attention
from .inline import InLineAttention
from .kernel import ELUAttention, KernelAttention, ReLUAttention
from .map_attention import LinearMapAttention
from .mhla import MultiHeadLinearAttention
from .softmax import SoftmaxAttention
from .ttt import TTTAttention

__all__ = ['ATTENTIONS', 'BaseAttention', 'attention_class', 'build_attention',
           'register_attention']
__all__ += ['ELUAttention', 'InLineAttention', 'KernelAttention', 'LinearMapAttention', 'ReLUAttention',
            'SoftmaxAttention']
__all__ += ['MultiHeadLinearAttention']
__all__ += ['TTTAttention']
