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
