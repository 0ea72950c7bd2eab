"""linvit_mm: linear-attention ViTs initialised from Softmax ViTs, for OpenMMLab.

Importing the package registers nothing in mmdet or mmseg; configs pull the
models, hooks and initialisers in with ``custom_imports``.
"""
from .utils.compat import register_config_scope
from .version import __version__, version_info

register_config_scope()

__all__ = ['__version__', 'version_info']
