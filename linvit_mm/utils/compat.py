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

    Then mmengine gives every dict with a ``type`` from a ``package::`` base the scope
    ``_scope_=package``, and builds it with that package's registries. linvit_mm's configs
    are mmpretrain, mmdet and mmseg configs (their ``default_scope`` says which) and our
    classes register into those libraries' registries, so there is no registry tree of a
    ``linvit_mm`` scope that could hold a dataset, hook or loop of all three: built under
    ``_scope_='linvit_mm'`` each printed "linvit_mm is not installed" (false) and "Failed to
    search registry with scope linvit_mm" and fell back to mmengine's root registry, which
    lacks the libraries' datasets and transforms. The dicts of a ``linvit_mm::`` base take
    the ``default_scope`` of that base instead (none when it has none: the including
    config's own then applies), as a copy of the base file would build. Every other
    package's scope is left as mmengine sets it, so a genuinely missing one still warns.
    """
    from mmengine.config import Config
    from mmengine.config import utils as config_utils
    config_utils.MODULE2PACKAGE.setdefault(PACKAGE, PACKAGE)
    for name in _INSTALL_PATH_USERS:
        module = importlib.import_module(name)
        if not getattr(module.get_installed_path, 'answers_for_linvit_mm', False):
            module.get_installed_path = _answering_for_linvit_mm(module.get_installed_path)
    convert = Config._dict_to_config_dict
    if not getattr(convert, 'scopes_linvit_mm_bases', False):
        Config._dict_to_config_dict = staticmethod(_scoping_linvit_mm_bases(convert))


def _answering_for_linvit_mm(get_installed_path):

    @functools.wraps(get_installed_path)
    def wrapper(package):
        if package == PACKAGE:
            return package_root()
        return get_installed_path(package)

    wrapper.answers_for_linvit_mm = True
    return wrapper


def _scoping_linvit_mm_bases(dict_to_config_dict):
    """mmengine's ``Config._dict_to_config_dict``, which gives the dicts of a base config their
    ``_scope_``, with the scope of a ``linvit_mm::`` base replaced by its ``default_scope``."""

    @functools.wraps(dict_to_config_dict)
    def wrapper(cfg, scope=None, has_scope=True):
        # mmengine calls it with the whole merged base dict first, then recurses into its
        # values with the scope it was given: replacing it at the top reaches every value
        if scope == PACKAGE and isinstance(cfg, dict):
            own = cfg.get('default_scope')
            scope = own if isinstance(own, str) else None
        return dict_to_config_dict(cfg, scope, has_scope)

    wrapper.scopes_linvit_mm_bases = True
    return wrapper
