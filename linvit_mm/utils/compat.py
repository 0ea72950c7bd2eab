"""Small, documented adaptations of the pinned OpenMMLab stack (see docs/environment.md).

Each function is idempotent and changes no installed file.
"""


def register_config_scope():
    """Let configs say ``_base_ = 'linvit_mm::cls/....py'``.

    mmengine resolves ``package::path`` only for packages in its fixed
    ``MODULE2PACKAGE`` table; the path itself is found through
    ``<package>/.mim/configs``, which setup.py's ``add_mim_extension`` provides.
    """
    from mmengine.config import utils as config_utils
    config_utils.MODULE2PACKAGE.setdefault('linvit_mm', 'linvit_mm')
