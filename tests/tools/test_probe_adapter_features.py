"""tools/analysis_tools/probe_adapter_features.py on the demo's Mask R-CNN config and the
generated mini COCO set."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DET_CONFIG = REPO / 'configs' / 'demo' / 'mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'


def load_tool():
    path = REPO / 'tools' / 'analysis_tools' / 'probe_adapter_features.py'
    spec = importlib.util.spec_from_file_location('probe_adapter_features', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = load_tool()


def coco_options(coco_root):
    coco = f'{coco_root}/'
    return ['--cfg-options', 'model.backbone.pretrained=None',
            f'train_dataloader.dataset.data_root={coco}',
            f'val_dataloader.dataset.data_root={coco}',
            f'test_dataloader.dataset.data_root={coco}']


def annotation_count(mini_data_root, split):
    path = mini_data_root / 'coco' / 'annotations' / f'instances_{split}2017.json'
    return len(json.loads(path.read_text())['annotations'])


def test_ridge_probe_separates_separable_classes_and_not_noise():
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(60) % 3
    centres = torch.randn(3, 50, generator=generator) * 3
    features = centres[labels] + 0.5 * torch.randn(60, 50, generator=generator)
    accuracy = probe.ridge_accuracy(features[:40], labels[:40], features[40:], labels[40:],
                                    3, penalty=1.0)
    assert accuracy == 1.0
    noise = torch.randn(600, 50, generator=generator)
    noise_labels = torch.arange(600) % 3
    accuracy = probe.ridge_accuracy(noise[:300], noise_labels[:300], noise[300:],
                                    noise_labels[300:], 3, penalty=1.0)
    assert accuracy < 0.5  # chance is 1/3


def test_every_box_of_both_splits_is_probed_from_each_source(mini_data_root, tmp_path):
    out = tmp_path / 'probe.json'
    result = probe.main([str(DET_CONFIG), '--out', str(out),
                         *coco_options(mini_data_root / 'coco')])
    assert result['train_boxes'] == annotation_count(mini_data_root, 'train')
    assert result['val_boxes'] == annotation_count(mini_data_root, 'val')
    assert set(result['accuracy']) == set(probe.SOURCES)
    assert all(0.0 <= value <= 1.0 for value in result['accuracy'].values())
    assert 0.0 < result['chance'] <= 1.0
    assert json.loads(out.read_text()) == result


def test_vit_map_is_the_vit_run_on_its_own(mini_data_root):
    """The probe's ``vit`` source is LinearViT's own forward, as a map."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    cfg = Config.fromfile(DET_CONFIG)
    cfg.model.backbone.pretrained = None
    init_default_scope('mmdet')
    model = probe.build_detector(cfg, None, seed=0)
    vit = model.backbone.vit
    images = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        got = probe.vit_feature_map(model.backbone, images)
        # LinearViT's own forward, asked for the last block's patch-token map
        vit.out_type, vit.out_indices = 'featmap', [vit.num_layers - 1]
        expected, = vit(images)
    assert got.shape == (2, vit.embed_dims, 96 // vit.patch_size, 128 // vit.patch_size)
    torch.testing.assert_close(got, expected)


def test_a_checkpoint_that_does_not_fit_is_refused(mini_data_root, tmp_path):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    cfg = Config.fromfile(DET_CONFIG)
    cfg.model.backbone.pretrained = None
    init_default_scope('mmdet')
    state = probe.build_detector(cfg, None, seed=0).state_dict()
    state.pop('backbone.spm.fc1.weight')
    checkpoint = tmp_path / 'partial.pth'
    torch.save(dict(state_dict=state), checkpoint)
    with pytest.raises(RuntimeError, match='backbone.spm.fc1.weight'):
        probe.main([str(DET_CONFIG), '--checkpoint', str(checkpoint),
                    *coco_options(mini_data_root / 'coco')])


def test_a_backbone_other_than_the_adapter_is_refused(mini_data_root, tmp_path):
    config = tmp_path / 'resnet.py'
    config.write_text(
        f"_base_ = ['{DET_CONFIG}']\n"
        "model = dict(backbone=dict(_delete_=True, type='ResNet', depth=18),\n"
        "             neck=dict(in_channels=[64, 128, 256, 512]))\n")
    options = coco_options(mini_data_root / 'coco')
    options.remove('model.backbone.pretrained=None')
    with pytest.raises(TypeError, match='backbone is ResNet'):
        probe.main([str(config), *options])


@pytest.mark.parametrize('bad', [['--ridge', '0'], ['--max-images', '0']],
                         ids=['ridge-zero', 'no-images'])
def test_bad_options_are_refused(bad):
    with pytest.raises(SystemExit):
        probe.parse_args([str(DET_CONFIG), *bad])


@pytest.mark.slow
def test_the_probe_finds_the_class_in_a_conv_stem_on_a_demo_sized_set(tmp_path):
    """A random convolutional stem keeps the shapes' outlines, which a linear probe reads
    (68 % on the demo's set, 64 x 64 images, chance 27 %): the probe is not blind."""
    from linvit_mm.staged.recipes import DEMO_SETS, DET_SET
    from linvit_mm.testing.mini_data import make_mini_coco
    make_mini_coco(tmp_path / 'coco', **DEMO_SETS[DET_SET][1])
    result = probe.main([str(DET_CONFIG), *coco_options(tmp_path / 'coco')])
    assert result['val_boxes'] >= 60
    assert result['accuracy']['spatial prior'] >= result['chance'] + 0.3
