"""linvit_mm: linear-attention ViTs initialised from Softmax ViTs, for OpenMMLab."""
from .version import __version__, version_info

__all__ = ['__version__', 'version_info']
