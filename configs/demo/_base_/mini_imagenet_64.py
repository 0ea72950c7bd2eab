# The generated mini classification sets (tools/dataset_converters/make_mini_data.py):
# 64 x 64 images in the ImageNet folder + annotation-file layout. ``data/mini/imagenet``
# holds shapes, ``imagenet_groups`` shape groups, ``imagenet_transfer`` textures (set
# data_root and classes).
data_root = 'data/mini/imagenet'
classes = ['circle', 'cross', 'ring', 'square', 'star', 'triangle']

data_preprocessor = dict(
    num_classes=6,
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    to_rgb=True)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=64, crop_ratio_range=(0.6, 1.0)),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='PackInputs'),
]
train_dataloader = dict(
    batch_size=32,
    num_workers=0,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        type='CustomDataset',
        data_root=data_root,
        ann_file='meta/train.txt',
        data_prefix='train',
        classes=classes,
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=64,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='CustomDataset',
        data_root=data_root,
        ann_file='meta/val.txt',
        data_prefix='val',
        classes=classes,
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator
