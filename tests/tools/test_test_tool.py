"""tools/test.py: the upstream options whose meaning depends on the config's scope (--out,
--out-item), --amp and --no-pin-memory; checked on the config, then run end to end on the
generated mini sets with a randomly initialised model of each scope."""
import importlib.util
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

REPO = Path(__file__).resolve().parents[2]
TINY_CLS = REPO / 'tests' / 'data' / 'configs' / 'tiny_cls_mini.py'
DEMO = REPO / 'configs' / 'demo'
DET = DEMO / 'mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py'
SEG = DEMO / 'upernet_linvit-adapter-relu-mini_mini-ade.py'


@pytest.fixture(scope='module')
def tool():
    spec = importlib.util.spec_from_file_location('linvit_test_tool', REPO / 'tools' / 'test.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def configured(tool, config, *options):
    args = tool.parse_args([str(config), 'unused.pth', *options])
    cfg = tool.merge_args(Config.fromfile(config), args)
    return cfg, args


# ---------------------------------------------------------------- the options, on the config
def test_mmseg_out_is_the_evaluator_output_dir(tool, tmp_path):
    cfg, args = configured(tool, SEG, '--out', str(tmp_path / 'maps'))
    assert tool.output_kind(cfg, args) == 'seg_maps'
    tool.write_segmentation_maps(cfg, args.out)
    assert cfg.test_evaluator.output_dir == str(tmp_path / 'maps')
    assert cfg.test_evaluator.keep_results is True


@pytest.mark.parametrize('config, options, kind', [
    (TINY_CLS, ['--out', 'p.pkl'], 'predictions'),
    (TINY_CLS, ['--out', 'p.pkl', '--out-item', 'pred'], 'predictions'),
    (TINY_CLS, ['--out', 'm.json', '--out-item', 'metrics'], 'metrics'),
    (TINY_CLS, ['--out', 'm.yaml', '--out-item', 'metrics'], 'metrics'),
    (DET, ['--out', 'p.pkl'], 'det_predictions'),
    (TINY_CLS, [], None),
], ids=['cls-pred-default', 'cls-pred', 'cls-metrics-json', 'cls-metrics-yaml', 'det', 'none'])
def test_out_per_scope(tool, config, options, kind):
    assert tool.output_kind(*configured(tool, config, *options)) == kind


@pytest.mark.parametrize('config, options, message', [
    (TINY_CLS, ['--out-item', 'metrics'], '--out-item needs --out'),
    (TINY_CLS, ['--out', 'p.json'], 'the predictions are pickled; use a .pkl file (or '
                                    '--out-item metrics'),
    (TINY_CLS, ['--out', 'm.txt', '--out-item', 'metrics'], 'use one of .json'),
    (DET, ['--out', 'p.json'], 'the predictions are pickled; use a .pkl file'),
    (DET, ['--out', 'p.pkl', '--out-item', 'pred'], "this config is 'mmdet', where --out dumps"),
    (SEG, ['--out', 'maps.pkl'], 'for mmseg configs --out is a directory'),
    (SEG, ['--out', 'maps', '--out-item', 'metrics'], 'is the directory for the predicted'),
], ids=['item-without-out', 'cls-json-pred', 'cls-metrics-txt', 'det-json', 'det-out-item',
        'seg-pickle', 'seg-out-item'])
def test_out_mistakes_are_refused_before_anything_runs(tool, config, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tool.output_kind(*configured(tool, config, *options))


def test_mmseg_out_must_not_be_a_file(tool, tmp_path):
    existing = tmp_path / 'maps'
    existing.write_text('')
    with pytest.raises(ValueError, match='give a directory path'):
        tool.output_kind(*configured(tool, SEG, '--out', str(existing)))


def test_amp_and_no_pin_memory(tool):
    cfg, _ = configured(tool, TINY_CLS, '--amp', '--no-pin-memory')
    assert cfg.test_cfg.fp16 is True
    assert cfg.test_dataloader.pin_memory is False
    cfg, _ = configured(tool, TINY_CLS)
    assert not cfg.get('test_cfg', {}).get('fp16') and cfg.test_dataloader.get('pin_memory',
                                                                                True)


# ---------------------------------------------------------------- end to end
def random_checkpoint(config, path, options=None):
    """The config's model with its random initialisation, saved as a run checkpoint."""
    from mmengine.registry import MODELS, init_default_scope

    import linvit_mm.models  # noqa: F401
    cfg = Config.fromfile(config)
    cfg.merge_from_dict(options or {})
    init_default_scope(cfg.default_scope)
    model = MODELS.build(cfg.model)
    torch.save({'state_dict': model.state_dict(), 'meta': {}}, path)
    return path


def run(tool, argv):
    return tool.main([str(a) for a in argv])


def cls_options(root):
    return [f'test_dataloader.dataset.data_root={root / "imagenet"}']


def test_classifier_dumps_predictions_or_metrics(tool, tmp_path, mini_data_root):
    ckpt = random_checkpoint(TINY_CLS, tmp_path / 'cls.pth')
    metrics = run(tool, [TINY_CLS, ckpt, '--work-dir', tmp_path, '--out', tmp_path / 'm.json',
                         '--out-item', 'metrics', '--cfg-options', *cls_options(mini_data_root)])
    assert json.loads((tmp_path / 'm.json').read_text()) == pytest.approx(metrics)
    assert 'accuracy/top1' in metrics
    run(tool, [TINY_CLS, ckpt, '--work-dir', tmp_path, '--out', tmp_path / 'p.pkl', '--amp',
               '--no-pin-memory', '--cfg-options', *cls_options(mini_data_root)])
    with open(tmp_path / 'p.pkl', 'rb') as f:
        predictions = pickle.load(f)
    val_images = (mini_data_root / 'imagenet' / 'meta' / 'val.txt').read_text().splitlines()
    assert len(predictions) == len(val_images) and 'pred_label' in predictions[0]


def test_detector_dumps_predictions_like_mmdet(tool, tmp_path, mini_data_root):
    ckpt = random_checkpoint(DET, tmp_path / 'det.pth', {'model.backbone.pretrained': None})
    coco = f'{mini_data_root / "coco"}/'
    # two images, few boxes: random weights would send 1000 proposals to the mask head
    run(tool, [DET, ckpt, '--work-dir', tmp_path, '--out', tmp_path / 'p.pkl', '--cfg-options',
               'model.backbone.pretrained=None', f'test_dataloader.dataset.data_root={coco}',
               'test_dataloader.dataset.indices=2', 'model.test_cfg.rpn.nms_pre=50',
               'model.test_cfg.rpn.max_per_img=20', 'model.test_cfg.rcnn.max_per_img=5',
               f'test_evaluator.ann_file={coco}annotations/instances_val2017.json'])
    with open(tmp_path / 'p.pkl', 'rb') as f:
        predictions = pickle.load(f)
    assert len(predictions) == 2 and 'pred_instances' in predictions[0]
    # mmdet's DumpDetResults, not mmengine's DumpResults: ground truth left out
    assert not any('gt_instances' in prediction for prediction in predictions)


def test_segmentor_writes_maps_into_out_dir(tool, tmp_path, mini_data_root):
    ckpt = random_checkpoint(SEG, tmp_path / 'seg.pth', {'model.backbone.pretrained': None})
    metrics = run(tool, [SEG, ckpt, '--work-dir', tmp_path, '--out', tmp_path / 'maps',
                         '--cfg-options', 'model.backbone.pretrained=None',
                         f'test_dataloader.dataset.data_root={mini_data_root / "ade"}',
                         'test_dataloader.dataset.indices=2', 'visualizer.name=test_tool_out_dir'])
    assert 'mIoU' in metrics
    assert len(list((tmp_path / 'maps').glob('*.png'))) == 2


def test_non_finite_weights_are_refused_before_testing(tool, tmp_path, mini_data_root):
    ckpt = random_checkpoint(TINY_CLS, tmp_path / 'cls.pth')
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint['state_dict']['head.layers.head.weight'][1, :3] = float('nan')
    torch.save(checkpoint, ckpt)
    out = tmp_path / 'm.json'
    argv = [TINY_CLS, ckpt, '--work-dir', tmp_path, '--out', out, '--out-item', 'metrics',
            '--cfg-options', *cls_options(mini_data_root)]
    with pytest.raises(ValueError, match=r'(?s)head.layers.head.weight: 3 NaN of .*'
                       r'--allow-non-finite'):
        run(tool, argv)
    assert not out.exists()
    assert 'accuracy/top1' in run(tool, argv + ['--allow-non-finite'])
