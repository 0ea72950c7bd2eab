"""Small, documented adaptations of the pinned OpenMMLab stack (see docs/environment.md).

Each function is idempotent and changes no installed file.
"""
import functools
import importlib
import os.path as osp

PACKAGE = 'linvit_mm'
# The mmengine modules that turn a package name into the directory holding its ``.mim``
# folder; each imported ``get_installed_path`` under its own name.
_INSTALL_PATH_USERS = ('mmengine.config.config', 'mmengine.hub.hub')


def package_root():
    """The directory of the ``linvit_mm`` package this process runs (holds ``.mim``)."""
    return osp.dirname(osp.dirname(osp.abspath(__file__)))


def register_config_scope():
    """Let configs say ``_base_ = 'linvit_mm::classification/imagenet/....py'``.

    mmengine resolves ``package::path`` in two steps, and neither works for linvit_mm as
    shipped:

    1. It accepts only the packages of its fixed ``MODULE2PACKAGE`` table, asserted before
       anything else, and has no other way to register one. ``linvit_mm`` is added to the
       table here, so a process must import ``linvit_mm`` before it parses such a config
       (the project's tools do; a config's ``custom_imports`` comes too late, as it is read
       after the bases).
    2. It reads ``<install path>/.mim/model-index.yml`` and ``.mim/configs/<path>``, taking
       the install path from the distribution's location. An editable install made with
       setuptools >= 80 keeps the distribution in site-packages and the code in the source
       tree, so that path does not exist. mmengine is answered with the directory of the
       package this process actually runs, which is right for every kind of install.
    """
    from mmengine.config import utils as config_utils
    config_utils.MODULE2PACKAGE.setdefault(PACKAGE, PACKAGE)
    for name in _INSTALL_PATH_USERS:
        module = importlib.import_module(name)
        if not getattr(module.get_installed_path, 'answers_for_linvit_mm', False):
            module.get_installed_path = _answering_for_linvit_mm(module.get_installed_path)


def _answering_for_linvit_mm(get_installed_path):

    @functools.wraps(get_installed_path)
    def wrapper(package):
        if package == PACKAGE:
            return package_root()
        return get_installed_path(package)

    wrapper.answers_for_linvit_mm = True
    return wrapper
