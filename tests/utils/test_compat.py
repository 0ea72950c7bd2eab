"""``linvit_mm::`` config paths: what mmengine needs and what importing linvit_mm gives it."""
import os.path as osp
import subprocess
import sys
import textwrap

import pytest
from mmengine.config import Config

import linvit_mm
from linvit_mm.utils.compat import package_root, register_config_scope

IMAGENET_CONFIG = 'classification/imagenet/linvit-relu-base_mlpcopy-distill_32xb128_in1k.py'


def test_scope_is_registered_once_and_other_packages_are_left_alone():
    import mmengine.config.config as config_module
    import mmengine.hub.hub as hub_module
    from mmengine.config.utils import MODULE2PACKAGE
    from mmengine.utils import get_installed_path
    register_config_scope()
    lookups = (config_module.get_installed_path, hub_module.get_installed_path)
    register_config_scope()
    assert (config_module.get_installed_path, hub_module.get_installed_path) == lookups
    assert MODULE2PACKAGE['linvit_mm'] == 'linvit_mm'
    for lookup in lookups:
        assert lookup('linvit_mm') == package_root()
        assert lookup('mmdet') == get_installed_path('mmdet')


def test_package_root_is_the_imported_package_and_holds_the_mim_folder():
    assert package_root() == osp.dirname(osp.abspath(linvit_mm.__file__))
    mim = osp.join(package_root(), '.mim')
    for name in ('configs', 'tools', 'model-index.yml'):
        assert osp.exists(osp.join(mim, name)), (
            f'{mim}/{name} is missing: install linvit_mm (bash tools/setup_env.sh, or '
            f'pip install -e .), which links it there')


def test_config_with_linvit_mm_bases_loads_and_is_resolved_from_the_package(tmp_path):
    config = tmp_path / 'mine.py'
    config.write_text(f"_base_ = 'linvit_mm::{IMAGENET_CONFIG}'\n"
                      "model = dict(backbone=dict(attn_type='elu'))\n")
    cfg = Config.fromfile(str(config))
    assert cfg.model.backbone.attn_type == 'elu'
    assert cfg.model.backbone.init_cfg.setting == 'mlpcopy'  # from the inherited config
    assert cfg.custom_hooks[0].type == 'AttentionDistillHook'


def test_mmengine_hub_finds_a_model_of_the_model_index():
    from mmengine.hub import get_config
    cfg = get_config(f'linvit_mm::{IMAGENET_CONFIG}')
    assert cfg.model.backbone.attn_type == 'relu'


def run_python(code, cwd):
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_only_a_process_that_imported_linvit_mm_resolves_its_paths(tmp_path):
    """mmengine has no way to discover a package's configs by itself: parsing a
    ``linvit_mm::`` path before ``import linvit_mm`` is refused (the README says so)."""
    config = tmp_path / 'mine.py'
    config.write_text(f"_base_ = 'linvit_mm::{IMAGENET_CONFIG}'\n")
    parse = f'from mmengine.config import Config; Config.fromfile({str(config)!r})'
    plain = run_python(parse, tmp_path)
    assert plain.returncode != 0
    assert 'mmengine does not support to load linvit_mm config' in plain.stderr
    imported = run_python(f'import linvit_mm; {parse}; print("loaded")', tmp_path)
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert imported.stdout.strip().endswith('loaded')


@pytest.fixture
def mini_coco_config(tmp_path, mini_data_root):
    """An mmdet config of one's own, in a folder outside the repository, built on the demo's
    Mask R-CNN through a ``linvit_mm::`` base; two iterations on the generated mini COCO."""
    coco = f'{mini_data_root / "coco"}/'
    config = tmp_path / 'my_mask_rcnn.py'
    config.write_text(textwrap.dedent(f"""\
        _base_ = 'linvit_mm::demo/mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'

        model = dict(backbone=dict(pretrained=None))
        train_dataloader = dict(batch_size=2, dataset=dict(data_root='{coco}', indices=4))
        train_cfg = dict(max_epochs=1, val_interval=1)
        val_cfg = None
        val_dataloader = None
        val_evaluator = None
        test_cfg = None
        test_dataloader = None
        test_evaluator = None
        default_hooks = dict(checkpoint=dict(interval=1), logger=dict(interval=1))
        """))
    return config


def test_linvit_mm_bases_train_with_the_upstream_runner(mini_coco_config, tmp_path):
    from mmengine.runner import Runner
    cfg = Config.fromfile(str(mini_coco_config))
    assert cfg.default_scope == 'mmdet'
    cfg.work_dir = str(tmp_path / 'work')
    runner = Runner.from_cfg(cfg)
    runner.train()
    assert runner.iter == 2
    assert (tmp_path / 'work' / 'epoch_1.pth').is_file()
