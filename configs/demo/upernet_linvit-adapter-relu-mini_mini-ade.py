# The demo's dense stage: UperNet + ViT-Adapter on a generated mini ADE20K set (6 classes after
# reduce_zero_label; the demo's are 64 x 64 images), the ViT initialised from a demo
# classification checkpoint (--cfg-options model.backbone.pretrained=PATH) or at random
# (pretrained=None). Thin overrides of the ADE20K configs: sizes and schedule.
_base_ = [
    '../_base_/models/upernet_linvit-adapter.py',
    'mmseg::_base_/datasets/ade20k.py',
    '../_base_/schedules/ade20k_adamw_160k_linvit.py',
    'mmseg::_base_/default_runtime.py',
    './_base_/adapter-mini.py',
]

data_root = 'data/mini/ade'
# mmseg accepts only a subset of ADE20K's names as a class override: the mini set's
# background and five shapes stand in for the first six (linvit_mm.testing.mini_data).
metainfo = dict(classes=('wall', 'building', 'sky', 'floor', 'tree', 'ceiling'))
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    # a mini set's images share one size: pad to a multiple of 32, not to a crop size
    data_preprocessor=dict(size=None, size_divisor=32),
    backbone={{_base_.mini_adapter}},
    decode_head=dict(
        in_channels=[96, 96, 96, 96], channels=64, num_classes=6, norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=96, channels=32, num_classes=6, norm_cfg=norm_cfg),
    test_cfg=dict(_delete_=True, mode='whole'))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(data_root=data_root, metainfo=metainfo, pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo, pipeline=test_pipeline))
test_dataloader = val_dataloader

max_iters = 400
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
optim_wrapper = dict(optimizer=dict(lr=2e-3))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=20, end=max_iters, by_epoch=False),
]
default_hooks = dict(
    logger=dict(interval=20), checkpoint=dict(interval=max_iters))
randomness = dict(seed=0)
