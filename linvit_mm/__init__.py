"""linvit_mm: linear-attention ViTs initialised from Softmax ViTs, for OpenMMLab.

Importing the package registers nothing in mmdet or mmseg (configs pull the models,
hooks and initialisers in with ``custom_imports``). It adapts two things of the
pinned stack, documented in ``linvit_mm.utils``: ``linvit_mm::`` config paths, and
checkpoint loading under torch >= 2.6 (run checkpoints load, code never runs).
"""
from .utils.checkpoint import install_checkpoint_policy
from .utils.compat import register_config_scope
from .version import __version__, version_info

register_config_scope()
install_checkpoint_policy()

__all__ = ['__version__', 'version_info']
