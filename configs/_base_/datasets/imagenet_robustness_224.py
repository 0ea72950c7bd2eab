# Robustness test sets of the paper's Table 2, evaluated with the ImageNet-1K test
# pipeline. The variables below are used by configs/classification/robustness/:
#   test_dataloader = dict(dataset={{_base_.imagenet_a_dataset}})
#   test_evaluator = {{_base_.imagenet_a_evaluator}}
# ImageNet-A / -R hold 200 of the 1000 classes: SubsetAccuracy takes the arg-max over
# those 200 logits. Layouts: docs/user_guides/dataset_prepare.md.
robustness_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=248, edge='short', backend='pillow', interpolation='bicubic'),
    dict(type='CenterCrop', crop_size=224),
    dict(type='PackInputs'),
]
imagenet_a_dataset = dict(
    _delete_=True, type='CustomDataset', data_root='data/imagenet-a',
    pipeline=robustness_pipeline)
imagenet_a_evaluator = dict(
    _delete_=True, type='SubsetAccuracy', subset='imagenet-a', topk=(1, 5))
imagenet_r_dataset = dict(
    _delete_=True, type='CustomDataset', data_root='data/imagenet-r',
    pipeline=robustness_pipeline)
imagenet_r_evaluator = dict(
    _delete_=True, type='SubsetAccuracy', subset='imagenet-r', topk=(1, 5))
# Sketch folders are ImageNet wnids, which sort into the ImageNet-1K label order.
imagenet_sketch_dataset = dict(
    _delete_=True, type='CustomDataset', data_root='data/imagenet-sketch/sketch',
    pipeline=robustness_pipeline)
imagenet_sketch_evaluator = dict(_delete_=True, type='Accuracy', topk=(1, 5))
imagenet_v2_dataset = dict(
    _delete_=True, type='ImageNetV2', data_root='data/imagenetv2-matched-frequency-format-val',
    pipeline=robustness_pipeline)
imagenet_v2_evaluator = dict(_delete_=True, type='Accuracy', topk=(1, 5))
