"""Configs with ``linvit_mm::`` bases under tools/train.py: their dicts build in the scope
their base declares, with no scope warning; a scope whose package is missing still warns."""
import contextlib
import importlib.util
import io
import uuid
from pathlib import Path

import pytest
from mmengine.config import Config

import linvit_mm  # noqa: F401  (registers the linvit_mm:: scope)

REPO = Path(__file__).resolve().parents[2]
DEMO_BASE = 'linvit_mm::demo/linvit-softmax-mini_random_1xb32_mini-shapes.py'
# What mmengine prints when a dict is built under a scope it cannot import or find.
SCOPE_WARNINGS = ('is not installed and its modules will not be registered',
                  'Failed to search registry with scope', 'Failed to import')


def load_train_tool():
    spec = importlib.util.spec_from_file_location('scope_train_tool', REPO / 'tools' / 'train.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_config(tmp_path, extra=''):
    config = tmp_path / 'mine.py'
    config.write_text(f"_base_ = '{DEMO_BASE}'\n{extra}")
    return config


def train_log(config, work_dir, mini_data_root):
    """The log of a one-iteration run of tools/train.py on the generated shapes set."""
    root = mini_data_root / 'imagenet'
    options = [f'{loader}.dataset.data_root={root}'
               for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    options += ['train_cfg.max_iters=1', 'train_dataloader.batch_size=4',
                'train_dataloader.num_workers=0', 'train_dataloader.persistent_workers=False',
                f'experiment_name=scope_{uuid.uuid4().hex[:12]}']
    stream = io.StringIO()
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        load_train_tool().main([str(config), '--work-dir', str(work_dir), '--no-validate',
                                '--cfg-options', *options])
    assert (work_dir / 'iter_1.pth').is_file(), stream.getvalue()[-3000:]
    return stream.getvalue()


def scope_warnings(log):
    return [line for line in log.splitlines() if any(text in line for text in SCOPE_WARNINGS)]


def test_a_linvit_mm_base_trains_without_scope_warnings(tmp_path, mini_data_root):
    log = train_log(write_config(tmp_path), tmp_path / 'work', mini_data_root)
    assert scope_warnings(log) == []


@pytest.mark.slow
def test_a_scope_whose_package_is_missing_still_warns(tmp_path, mini_data_root):
    if importlib.util.find_spec('mmpose') is not None:
        pytest.skip('mmpose is installed here; the test needs a package that is not')
    # EmptyCacheHook is mmengine's own, so the fallback to mmengine's registry still builds it
    config = write_config(tmp_path, "custom_hooks = [dict(type='EmptyCacheHook', "
                          "_scope_='mmpose')]\n")
    warnings = scope_warnings(train_log(config, tmp_path / 'work', mini_data_root))
    assert any('mmpose is not installed' in line for line in warnings), warnings
    assert any('Failed to search registry with scope "mmpose"' in line for line in warnings)
    assert not any('linvit_mm' in line for line in warnings), warnings


@pytest.mark.parametrize('base, scope', [
    pytest.param(DEMO_BASE, 'mmpretrain', id='linvit_mm-base-takes-its-default-scope'),
    pytest.param('linvit_mm::_base_/models/linvit/linvit-tiny.py', None,
                 id='linvit_mm-base-without-default-scope-takes-none'),
    pytest.param('mmpretrain::_base_/models/vit-base-p16.py', 'mmpretrain',
                 id='other-package-keeps-mmengines-scope'),
])
def test_base_dicts_get_the_scope_of_their_base(tmp_path, base, scope):
    config = tmp_path / 'mine.py'
    config.write_text(f"_base_ = '{base}'\n")
    cfg = Config.fromfile(str(config))
    assert cfg.model.get('_scope_') == scope
    if base == DEMO_BASE:
        assert cfg.train_dataloader.dataset.get('_scope_') == scope
        assert cfg.default_hooks.checkpoint.get('_scope_') == scope


def test_the_linvit_mm_scope_is_importable_where_mmengine_looks(caplog):
    # A dict that names _scope_='linvit_mm' itself: mmengine imports linvit_mm.registry and
    # finds the operators' registry, and says nothing false about the package.
    import logging

    from mmengine.logging import MMLogger
    from mmengine.registry import MODELS

    from linvit_mm.models.attention import ATTENTIONS
    logger = MMLogger.get_current_instance()
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING), \
                MODELS.switch_scope_and_registry('linvit_mm') as registry:
            assert registry is ATTENTIONS
    finally:
        logger.removeHandler(caplog.handler)
    assert scope_warnings(caplog.text) == []
