#!/usr/bin/env python
"""Which of the ViT-Adapter's feature sources tell the objects of a detection set apart.

A detector learns its box classifier from the features that RoIAlign pools inside each box.
This tool measures, before any detector training, how much class information each source
the adapter combines carries there: for every ground-truth box of the config's training and
validation sets it pools a 7 x 7 grid (RoIAlign) from

* ``spatial prior``: the adapter's convolutional stem at stride 4 (its own, untrained
  unless ``--checkpoint`` holds trained weights),
* ``vit``: the ViT's patch tokens after its last block, run on its own (no injector),
  as a map at stride ``patch_size``: what the classification checkpoint learned,
* ``adapter``: the adapter's stride-4 output, the finest map the detector's neck receives
  (the spatial prior, the extracted multi-scale features and the ViT map, summed and
  normalised),

fits a ridge classifier (one-hot targets, ``--ridge`` penalty on standardised features) on
the training boxes and prints its accuracy on the validation boxes, beside chance (the
largest class's share of the validation boxes). A source far above chance is one the
detector's heads can learn from; when ``adapter`` sits well below ``spatial prior``, the
adapter's sum drowns the stem's detail in the other sources.

The model is the config's ``model`` (an mmdet detector whose backbone is
``LinearViTAdapter``), initialised as for training (the ``pretrained`` ViT loaded) or from
``--checkpoint`` (a run checkpoint of the whole detector, loaded strictly). Images and boxes
come from the config's ``train_dataloader`` and ``val_dataloader`` datasets through the
config's test pipeline (no flips or crops), in the frame the features are computed in.

Example (the demo's detection stage; ``CLASSIFIER`` the checkpoint the demo carries into
it, ``work_dirs/demo/relu/<recipe>/seed<N>/<stage>/iter_200.pth``)::

    python tools/analysis_tools/probe_adapter_features.py \\
        configs/demo/mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py \\
        --cfg-options model.backbone.pretrained=$CLASSIFIER \\
        train_dataloader.dataset.data_root=data/mini/coco_demo/ \\
        val_dataloader.dataset.data_root=data/mini/coco_demo/
"""
import argparse
import json

import torch

SOURCES = ('spatial prior', 'vit', 'adapter')
ROI_SIZE = 7


def parse_args(argv=None):
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('config', help='an mmdet detector config with a LinearViTAdapter')
    parser.add_argument('--checkpoint', help='weights of the whole detector (run checkpoint); '
                        'default: the initialisation the config trains from')
    parser.add_argument('--ridge', type=float, default=100.0,
                        help='ridge penalty of the linear probe (default 100)')
    parser.add_argument('--max-images', type=int, default=None,
                        help='at most this many images from each split')
    parser.add_argument('--seed', type=int, default=0, help='seed of the untrained parts')
    parser.add_argument('--out', help='also write the result as JSON here')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, default={})
    args = parser.parse_args(argv)
    if args.ridge <= 0:
        parser.error(f'--ridge must be > 0, got {args.ridge}')
    if args.max_images is not None and args.max_images < 1:
        parser.error(f'--max-images must be >= 1, got {args.max_images}')
    return args


def build_detector(cfg, checkpoint, seed):
    from mmdet.registry import MODELS
    from mmengine.runner import load_checkpoint

    from linvit_mm.models import LinearViTAdapter
    torch.manual_seed(seed)
    model = MODELS.build(cfg.model)
    if not isinstance(model.backbone, LinearViTAdapter):
        raise TypeError(f'the config\'s backbone is {type(model.backbone).__name__}; this tool '
                        f'probes a LinearViTAdapter')
    if checkpoint is None:
        model.init_weights()
    else:
        load_checkpoint(model, checkpoint, map_location='cpu', strict=True)
    return model.eval()


def vit_feature_map(adapter, images):
    """The ViT's patch tokens after its last block, as a ``(B, C, h, w)`` map."""
    from linvit_mm.models.adapters.multi_scale import split_maps
    vit = adapter.vit
    tokens, grid = vit.embed(images)
    for layer in vit.layers:
        tokens = layer(tokens, grid)
    return split_maps(tokens[:, vit.num_extra_tokens:], [grid])[0]


def source_maps(model, images):
    """Each source's map and its stride, for a preprocessed batch."""
    adapter = model.backbone
    return {
        'spatial prior': (adapter.spm(images)[0], 4),
        'vit': (vit_feature_map(adapter, images), adapter.vit.patch_size),
        'adapter': (adapter(images)[0], 4),
    }


def pooled_boxes(model, dataset, max_images):
    """RoIAlign features of every ground-truth box: {source: (N, D)} and labels (N,)."""
    from mmcv.ops import roi_align
    features = {name: [] for name in SOURCES}
    labels = []
    count = len(dataset) if max_images is None else min(max_images, len(dataset))
    for index in range(count):
        item = dataset[index]
        sample = item['data_samples']
        boxes = sample.gt_instances.bboxes
        boxes = getattr(boxes, 'tensor', boxes).float()
        if not len(boxes):
            continue
        batch = model.data_preprocessor(dict(inputs=[item['inputs']], data_samples=[sample]),
                                        False)
        rois = torch.cat((boxes.new_zeros(len(boxes), 1), boxes), dim=1)
        with torch.no_grad():
            for name, (feature_map, stride) in source_maps(model, batch['inputs']).items():
                # every map on one scale, so that the probe's penalty treats them alike
                feature_map = (feature_map - feature_map.mean()) / (feature_map.std() + 1e-6)
                pooled = roi_align(feature_map, rois, (ROI_SIZE, ROI_SIZE), 1.0 / stride, 0,
                                   'avg', True)
                features[name].append(pooled.flatten(1))
        labels.append(sample.gt_instances.labels)
    if not labels:
        raise ValueError(f'{type(dataset).__name__} at {dataset.data_root!r} has no '
                         f'ground-truth boxes in its first {count} images')
    return {name: torch.cat(parts) for name, parts in features.items()}, torch.cat(labels)


def ridge_accuracy(train_x, train_y, val_x, val_y, num_classes, penalty):
    """Validation accuracy of a ridge classifier on standardised features."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x = ((train_x - mean) / std).double()
    val_x = ((val_x - mean) / std).double()
    targets = torch.nn.functional.one_hot(train_y, num_classes).double()
    # the dual form: as many unknowns as training boxes, fewer than feature dimensions
    gram = train_x @ train_x.T + penalty * torch.eye(len(train_x), dtype=torch.float64)
    weights = train_x.T @ torch.linalg.solve(gram, targets)
    return float(((val_x @ weights).argmax(1) == val_y).double().mean())


def build_split(cfg, loader):
    from mmdet.registry import DATASETS
    dataset_cfg = cfg[loader].dataset.copy()
    dataset_cfg.pipeline = cfg.test_dataloader.dataset.pipeline
    if 'LoadAnnotations' not in {step['type'] for step in dataset_cfg.pipeline}:
        raise ValueError("the config's test pipeline must load the annotations "
                         "(LoadAnnotations): the probe pools the ground-truth boxes")
    return DATASETS.build(dataset_cfg)


def main(argv=None):
    args = parse_args(argv)
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.utils import import_modules_from_strings
    cfg = Config.fromfile(args.config)
    cfg.merge_from_dict(args.cfg_options)
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg['custom_imports'])
    init_default_scope(cfg.get('default_scope', 'mmdet'))

    model = build_detector(cfg, args.checkpoint, args.seed)
    train_set, val_set = build_split(cfg, 'train_dataloader'), build_split(cfg, 'val_dataloader')
    classes = train_set.metainfo['classes']
    train_x, train_y = pooled_boxes(model, train_set, args.max_images)
    val_x, val_y = pooled_boxes(model, val_set, args.max_images)
    chance = float(torch.bincount(val_y, minlength=len(classes)).max()) / len(val_y)
    result = dict(classes=list(classes), train_boxes=len(train_y), val_boxes=len(val_y),
                  chance=chance, ridge=args.ridge, checkpoint=args.checkpoint,
                  accuracy={name: ridge_accuracy(train_x[name], train_y, val_x[name], val_y,
                                                 len(classes), args.ridge)
                            for name in SOURCES})
    print(f'class accuracy of a ridge probe on {ROI_SIZE}x{ROI_SIZE} RoIAlign features of the '
          f'ground-truth boxes ({len(train_y)} training, {len(val_y)} validation boxes, '
          f'{len(classes)} classes; chance {100 * chance:.1f} %):')
    for name in SOURCES:
        print(f'  {name:<14} {100 * result["accuracy"][name]:5.1f} %')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == '__main__':
    main()
