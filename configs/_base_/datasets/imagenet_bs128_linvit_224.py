# ImageNet-1K as in the paper (Table B): RandomResizedCrop 224 + flip + colour jitter 0.4;
# evaluation: resize the short edge to 248 and centre-crop 224 (crop ratio 0.9).
# Expects mmpretrain's layout under data/imagenet (see docs/user_guides/dataset_prepare.md).
_base_ = ['mmpretrain::_base_/datasets/imagenet_bs64_swin_224.py']

data_root = 'data/imagenet'
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=224, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='ColorJitter', brightness=0.4, contrast=0.4, saturation=0.4),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=248, edge='short', backend='pillow', interpolation='bicubic'),
    dict(type='CenterCrop', crop_size=224),
    dict(type='PackInputs'),
]
train_dataloader = dict(
    batch_size=128, num_workers=8, dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=128, num_workers=8, dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
