_base_ = [
    '../_base_/models/mask-rcnn_linvit-adapter_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    '../_base_/schedules/coco_adamw_1x_linvit.py',
    'mmdet::_base_/default_runtime.py',
]

# Classification-stage checkpoint: what
#   tools/train.py configs/classification/imagenet/linvit-softmax-base_fullcopy_32xb128_in1k.py
# writes by default (override: --cfg-options model.backbone.pretrained=PATH).
linvit_checkpoint = 'work_dirs/linvit-softmax-base_fullcopy_32xb128_in1k/epoch_300.pth'
model = dict(
    backbone=dict(
        vit=dict(arch='base', attn_type='softmax', drop_path_rate=0.3),
        pretrained=linvit_checkpoint),
    neck=dict(in_channels=[768, 768, 768, 768]))
