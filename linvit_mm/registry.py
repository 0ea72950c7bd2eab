"""The registry module of the ``linvit_mm`` scope, where mmengine looks for one
(``<scope>.registry``) when something is built under ``_scope_='linvit_mm'``.

linvit_mm's own registry is the attention operators' (a child of mmpretrain's model
registry); its models, hooks and initialisers register into mmpretrain's, mmdet's, mmseg's
and mmengine's registries, and the dicts of a ``linvit_mm::`` base build under that base's
``default_scope`` (``linvit_mm.utils.compat.register_config_scope``).
"""
from .models.attention.base import ATTENTIONS

__all__ = ['ATTENTIONS']
