"""tools/misc/make_config.py: the configs of the repository are what it writes, and what it
writes for the combinations that have no file builds and runs."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from mmengine.config import Config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / 'tools' / 'misc' / 'make_config.py'


@pytest.fixture(scope='module')
def make_config():
    spec = importlib.util.spec_from_file_location('make_config', SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_of_the_grid_folders_is_what_the_script_writes(make_config):
    assert len(make_config.grid_configs()) > 50
    problems = make_config.check()
    assert not problems, '\n'.join(problems)


def test_check_names_a_config_that_differs(make_config, tmp_path):
    path, text = make_config.render('linvit-relu-base_copy_32xb128_in1k')
    changed = tmp_path / path.name
    changed.write_text(text.replace("'copy'", "'mlpcopy'"))
    same = tmp_path / 'linvit-relu-base_copy-distill_32xb128_in1k.py'
    same.write_text(make_config.render(same.name)[1])
    notes = tmp_path / 'my_notes.py'
    notes.write_text('x = 1\n')
    problems = make_config.check([changed, same, notes])
    assert len(problems) == 2
    assert problems[0].startswith(f'{changed} differs')
    assert "+model = dict(backbone=dict(attn_type='relu', init_cfg=dict(setting='copy')))" \
        in problems[0]
    assert problems[1].startswith(f'{notes}: ') and 'not a name of the config grid' in \
        problems[1]
    misplaced = make_config.CONFIGS / 'detection' / path.name
    assert make_config.check([misplaced]) == [
        f'configs/detection/{path.name}: belongs in configs/classification/imagenet/{path.name}']


def test_written_config_reads_as_its_name_and_inherits_through_linvit_mm(make_config,
                                                                          tmp_path):
    path, text = make_config.render('linvit-elu-tiny_mimetic-distill_32xb128_in1k', tmp_path)
    assert path == tmp_path / 'linvit-elu-tiny_mimetic-distill_32xb128_in1k.py'
    assert "'linvit_mm::_base_/models/linvit/linvit-tiny.py'" in text
    path.write_text(text)
    cfg = Config.fromfile(str(path))
    assert cfg.model.backbone.attn_type == 'elu'
    assert cfg.model.backbone.arch == 'tiny'
    assert cfg.model.backbone.init_cfg.setting == 'mimetic'
    assert cfg.custom_hooks[0].type == 'AttentionDistillHook'
    assert cfg.train_cfg.max_epochs == make_config.IMAGENET_EPOCHS


def test_written_dense_config_starts_from_the_imagenet_stage_of_its_operator(make_config):
    name = 'upernet_linvit-adapter-softmax-base_8xb2-160k_ade20k-512x512'
    path, text = make_config.render(name)
    assert path == REPO / 'configs' / 'segmentation' / f'{name}.py'
    assert "_base_ = './_base_/upernet_linvit-adapter-base_8xb2-160k_ade20k-512x512.py'" in text
    assert ("linvit_checkpoint = 'work_dirs/linvit-softmax-base_fullcopy_32xb128_in1k/"
            "epoch_300.pth'") in text
    assert 'linvit-mhla-base_fullcopy-distill_32xb128_in1k' in make_config.render(
        'mask-rcnn_linvit-adapter-mhla-base_fpn_1x_coco')[1]


@pytest.mark.parametrize('name, op, hybrid, size', [
    ('linvit-relu-dinov2-small_fullcopy-distill_32xb128_in1k', 'relu', None, 'dinov2-small'),
    ('mask-rcnn_linvit-adapter-ttt-hybrid-dinov3-base_fpn_1x_coco', 'ttt', '-hybrid',
     'dinov3-base'),
    ('linvit-relu-hybrid-small_fullcopy-distill_32xb128_in1k', 'relu', '-hybrid', 'small'),
])
def test_a_source_is_a_size_with_a_hyphen(make_config, name, op, hybrid, size):
    """A foundation-model source's base (dinov2-small) reads as the size field, beside an
    operator and a hybrid; its dense configs start from its own ImageNet stage."""
    _, fields, _ = make_config.parse(name)
    assert (fields['op'], fields['hybrid'], fields['size']) == (op, hybrid, size)
    if name.startswith('mask-rcnn'):
        text = make_config.render(name)[1]
        assert 'mask-rcnn_linvit-adapter-dinov3-base_fpn_1x_coco.py' in text
        assert 'linvit-ttt-hybrid-dinov3-base_fullcopy-distill_32xb128_in1k/epoch_300' in text


@pytest.mark.parametrize('name, message', [
    ('linvit-ttt-small_mimetic_32xb128_in1k', "mimetic setting is not defined for the 'ttt'"),
    ('linvit-gelu-small_copy_32xb128_in1k', "unknown attention operator 'gelu'; registered"),
    ('linvit-relu-huge_copy_32xb128_in1k', "no size 'huge' in configs/ for "
     'classification/imagenet; valid: base, dinov2-base, dinov2-large, dinov2-small, '
     'dinov3-base, dinov3-small, small, tiny'),
    ('linvit-relu-small_halfcopy_32xb128_in1k', "unknown transfer setting 'halfcopy'"),
    ('linvit-relu-small_copy_8xb64_mnist', "no dataset 'mnist'"),
    ('linvit-relu-small_32xb128_in1k-c', "no testset 'c' in configs/ for "
     'classification/robustness; valid: a, r, sketch, v2'),
    ('mask-rcnn_linvit-adapter-relu-huge_fpn_1x_coco', "no size 'huge'"),
    ('linvit-relu-small_copy_in1k', 'not a name of the config grid'),
], ids=['mimetic-on-ttt', 'operator', 'size', 'setting', 'dataset', 'testset',
        'dense-size', 'name'])
def test_refused_names_say_what_is_wrong(make_config, name, message):
    with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(')', r'\)')):
        make_config.render(name)


@pytest.mark.slow
def test_cli_refuses_before_writing_anything(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), 'linvit-relu-tiny_copy_32xb128_in1k',
         'linvit-ttt-tiny_impulse_32xb128_in1k', '--out-dir', str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "impulse setting is not defined for the 'ttt' operator" in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_cli_keeps_a_config_that_exists_with_other_contents(tmp_path):
    mine = tmp_path / 'linvit-relu-tiny_copy_32xb128_in1k.py'
    mine.write_text('# my own\n')
    cmd = [sys.executable, str(SCRIPT), mine.stem, '--out-dir', str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and 'exists with other contents' in result.stderr
    assert mine.read_text() == '# my own\n'
    assert subprocess.run(cmd + ['--force'], capture_output=True, timeout=300).returncode == 0
    assert "setting='copy'" in mine.read_text()


def test_a_hybrid_name_keeps_softmax_in_the_first_and_last_blocks(make_config, tmp_path):
    path, text = make_config.render('linvit-relu-hybrid-small_fullcopy-distill_32xb128_in1k',
                                    tmp_path)
    path.write_text(text)
    backbone = Config.fromfile(str(path)).model.backbone
    # _delete_ replaced the base's attn_type name (a dict cannot be merged into it)
    assert backbone.attn_type == dict(default='relu', softmax=[0, -1])
    assert 'with_cls_token' not in backbone and backbone.init_cfg.setting == 'fullcopy'
    dense = make_config.render('mask-rcnn_linvit-adapter-relu-hybrid-base_fpn_1x_coco')[1]
    assert 'work_dirs/linvit-relu-hybrid-base_fullcopy-distill_32xb128_in1k/epoch_300.pth' \
        in dense
    assert "vit=dict(attn_type=dict(_delete_=True, default='relu', softmax=[0, -1]))" in dense
    # an operator without class token keeps its pooling; the Softmax blocks see the patches
    ttt = make_config.render('upernet_linvit-adapter-ttt-hybrid-tiny_8xb2-160k_ade20k-512x512')
    assert 'with_cls_token=False' in ttt[1]


def test_a_softmax_hybrid_is_refused(make_config):
    with pytest.raises(ValueError, match='softmax-hybrid: a hybrid keeps Softmax in blocks '
                                         r'\[0, -1\] of a model of another operator'):
        make_config.render('linvit-softmax-hybrid-small_fullcopy_32xb128_in1k')
