"""linvit_mm: linear-attention ViTs initialised from Softmax ViTs, for OpenMMLab.

Importing the package registers nothing in mmdet or mmseg (configs pull the models,
hooks and initialisers in with ``custom_imports``). It adapts two things of the
pinned stack, documented in ``linvit_mm.utils``: ``linvit_mm::`` config paths, and
checkpoint loading under torch >= 2.6 (run checkpoints load, code never runs).
"""
# First, before anything imports torch: a tool's OpenMP settings must precede libgomp's load;
# a process that is not one of the tools is left alone (see cpu_threads).
from .cpu_threads import configure_if_tool

configure_if_tool()

from .utils.checkpoint import install_checkpoint_policy  # noqa: E402
from .utils.compat import register_config_scope  # noqa: E402
from .version import __version__, version_info  # noqa: E402

register_config_scope()
install_checkpoint_policy()

__all__ = ['__version__', 'version_info']
