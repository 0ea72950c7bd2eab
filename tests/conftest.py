"""Fixtures shared by the whole test suite."""
import contextlib
import functools
import logging
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter runs the fused kernels on the CPU (tests/ops). It must be on before
    # triton is first imported, by anything: its language library is decorated then. It
    # changes nothing else: CPU tensors take the kernels only where a test asks
    # (LINVIT_MM_FUSED=1), and inductor compiles C++ for the CPU.
    os.environ.setdefault('TRITON_INTERPRET', '1')

TINY_CONFIG = Path(__file__).parent / 'data' / 'configs' / 'tiny_cls_mini.py'


@pytest.fixture(scope='session')
def mini_data_root(tmp_path_factory):
    """Root (``pathlib.Path``) of the default generated mini sets, written once a session.

    Holds ``imagenet`` (shapes), ``imagenet_transfer`` (textures), ``coco`` and ``ade``.
    ``make_mini_all(mini_data_root)`` returns their summaries (class names, annotation
    files, data prefixes) at no cost, as the sets are already there.
    """
    from linvit_mm.testing.mini_data import make_mini_all
    root = tmp_path_factory.mktemp('mini_data')
    make_mini_all(root)
    return root


@pytest.fixture(scope='session', autouse=True)
def external_bases_resolved_once():
    """mmengine finds a ``package::`` base (``mmdet::``, ``mmseg::``, ``linvit_mm::``) by
    reloading pkg_resources and parsing every metafile of the package, a second or more for
    mmdet, for each base of each config the suite loads; the installed packages stay as they
    are during the run, so each package is checked and each metafile parsed once (the parsed
    metafiles are only read). Config resolution itself runs unchanged."""
    import mmengine.config.config as config_module
    import mmengine.config.utils as config_utils
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_module, 'is_installed', functools.cache(config_module.is_installed))
        patch.setattr(config_utils, 'load', functools.cache(config_utils.load))
        yield


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


@pytest.fixture(scope='session')
def teacher_ckpt(tmp_path_factory):
    """Weights of a softmax LinearViT shaped like the backbone of ``TINY_CONFIG``, in the
    backbone's own names: the distillation teacher of the hook and fidelity tests."""
    import torch
    from mmengine.config import Config

    from linvit_mm.models import LinearViT
    backbone = Config.fromfile(str(TINY_CONFIG)).model.backbone.to_dict()
    backbone.pop('type')
    backbone['attn_type'] = 'softmax'
    torch.manual_seed(0)
    teacher = LinearViT(**backbone)
    teacher.init_weights()
    path = tmp_path_factory.mktemp('teacher') / 'teacher.pth'
    torch.save(teacher.state_dict(), path)
    return path


def pytest_make_parametrize_id(config, val, argname):
    """Grids and block counts, pairs of ints, read ``14x14`` in test ids."""
    if isinstance(val, tuple) and len(val) == 2 and all(type(v) is int for v in val):
        return f'{val[0]}x{val[1]}'
    return None


@pytest.fixture(params=['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
def device(request):
    """Run a test on the CPU and again on CUDA (marked ``cuda``: ``pytest tests -m cuda`` runs
    only those); the CUDA case is skipped where ``torch.cuda.is_available()`` is False."""
    import torch
    if request.param == 'cuda' and not torch.cuda.is_available():
        pytest.skip('CUDA is not available (torch.cuda.is_available() is False)')
    return request.param


@pytest.fixture
def logged():
    """``with logged(name=None, level=logging.DEBUG) as messages:`` the messages the MMLogger
    ``name`` (the current one without a name) receives at ``level`` or above in the block."""
    from mmengine.logging import MMLogger

    @contextlib.contextmanager
    def capture(name=None, level=logging.DEBUG):
        logger = MMLogger.get_instance(name) if name else MMLogger.get_current_instance()
        messages = []
        handler = logging.Handler(level=level)
        handler.emit = lambda record: messages.append(record.getMessage())
        logger.addHandler(handler)
        try:
            yield messages
        finally:
            logger.removeHandler(handler)
    return capture


@pytest.fixture
def init_info(monkeypatch):
    """``{parameter name: init info}`` of the last top-level ``init_weights``, as mmengine
    would log it."""
    from mmengine.model import BaseModule
    recorded = {}

    def record(module):
        recorded.clear()
        recorded.update((name, module._params_init_info[param]['init_info'])
                        for name, param in module.named_parameters())

    monkeypatch.setattr(BaseModule, '_dump_init_info', record)
    return recorded
