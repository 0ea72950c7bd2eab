# A tiny classifier on the generated mini ImageNet set, for tests of the tools.
# The test passes data_root with --cfg-options.
_base_ = ['mmpretrain::_base_/default_runtime.py']

custom_imports = dict(imports=['linvit_mm.models'], allow_failed_imports=False)

data_root = 'data/mini/imagenet'
classes = ['circle', 'square', 'triangle', 'cross', 'star', 'ring']
model = dict(
    type='ImageClassifier',
    backbone=dict(
        type='LinearViT',
        arch=dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64),
        attn_type='relu',
        img_size=32,
        patch_size=8),
    neck=None,
    head=dict(
        type='VisionTransformerClsHead',
        num_classes=6,
        in_channels=32,
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1)))

data_preprocessor = dict(
    num_classes=6,
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    to_rgb=True)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=32),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=32, edge='short'),
    dict(type='CenterCrop', crop_size=32),
    dict(type='PackInputs'),
]
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    dataset=dict(type='CustomDataset', data_root=data_root, ann_file='meta/train.txt',
                 data_prefix='train', classes=classes, pipeline=train_pipeline),
    sampler=dict(type='DefaultSampler', shuffle=True))
val_dataloader = dict(
    batch_size=8,
    num_workers=0,
    dataset=dict(type='CustomDataset', data_root=data_root, ann_file='meta/val.txt',
                 data_prefix='val', classes=classes, pipeline=test_pipeline),
    sampler=dict(type='DefaultSampler', shuffle=False))
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_dataloader = val_dataloader
test_evaluator = val_evaluator

optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05))
param_scheduler = [dict(type='ConstantLR', factor=1.0, by_epoch=False)]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=2, val_interval=2)
val_cfg = dict()
test_cfg = dict()

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=1),
    checkpoint=dict(type='CheckpointHook', interval=1, by_epoch=False))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
