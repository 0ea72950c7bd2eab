"""Fixtures shared by the whole test suite."""
import pytest


@pytest.fixture(scope='session')
def mini_data_root(tmp_path_factory):
    """Root (``pathlib.Path``) of the default generated mini sets, written once a session.

    Holds ``imagenet`` (shapes), ``imagenet_transfer`` (textures), ``coco`` and ``ade``.
    ``make_mini_all(mini_data_root)`` returns their summaries (class names, annotation
    files, data prefixes) at no cost, as the sets are already there.
    """
    from linvit_mm.datasets.mini_data import make_mini_all
    root = tmp_path_factory.mktemp('mini_data')
    make_mini_all(root)
    return root


@pytest.fixture(autouse=True)
def isolated_default_scope():
    """Each test starts from the default-scope state of the session start.

    ``init_default_scope`` changes a process-wide current scope, and mmengine's
    ``Registry.build`` then looks types up in that scope's registry: one test that sets
    ``mmseg`` would make a later ``mmpretrain.registry.DATASETS.build`` fail, so results would
    depend on test order.
    """
    from mmengine.registry import DefaultScope
    saved = DefaultScope._instance_dict.copy()
    yield
    DefaultScope._instance_dict = saved
