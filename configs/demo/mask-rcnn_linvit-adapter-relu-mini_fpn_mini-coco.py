# The demo's dense stage: Mask R-CNN + ViT-Adapter on a generated mini COCO set (the demo's
# are 64 x 64 images, others are resized to fit 64 x 64), the ViT initialised from a demo
# classification checkpoint (--cfg-options model.backbone.pretrained=PATH) or at random
# (pretrained=None). Thin overrides of the COCO configs: sizes and schedule.
_base_ = [
    '../_base_/models/mask-rcnn_linvit-adapter_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    '../_base_/schedules/coco_adamw_1x_linvit.py',
    'mmdet::_base_/default_runtime.py',
    './_base_/adapter-mini.py',
]

data_root = 'data/mini/coco/'
metainfo = dict(classes=('circle', 'square', 'triangle', 'star'))
channels = 64
model = dict(
    backbone={{_base_.mini_adapter}},
    neck=dict(in_channels=[96, 96, 96, 96], out_channels=channels),
    rpn_head=dict(
        in_channels=channels,
        feat_channels=channels,
        # objects here are 10-60 pixels: anchors of 16-256 instead of 32-512
        anchor_generator=dict(scales=[4])),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=channels),
        bbox_head=dict(in_channels=channels, fc_out_channels=256, num_classes=4),
        mask_roi_extractor=dict(out_channels=channels),
        mask_head=dict(in_channels=channels, conv_out_channels=channels, num_classes=4)),
    # a few objects in small images: far fewer proposals and sampled RoIs than COCO's
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=200, max_per_img=100),
        rcnn=dict(sampler=dict(num=64))),
    test_cfg=dict(
        rpn=dict(nms_pre=200, max_per_img=100),
        rcnn=dict(max_per_img=20)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(64, 64), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(64, 64), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator

max_epochs = 12
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)
optim_wrapper = dict(optimizer=dict(lr=4e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[9, 11],
         gamma=0.1),
]
default_hooks = dict(
    logger=dict(interval=10), checkpoint=dict(interval=max_epochs))
randomness = dict(seed=0)
