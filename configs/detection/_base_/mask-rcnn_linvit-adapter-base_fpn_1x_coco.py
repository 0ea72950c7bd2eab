# Mask R-CNN + FPN, COCO 1x, with a ViT-Adapter around a LinearViT-Base. A config names
# the attention operator and the ImageNet-stage checkpoint of the same operator and size;
# see README.md in the folder above.
_base_ = [
    '../../_base_/models/mask-rcnn_linvit-adapter_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    '../../_base_/schedules/coco_adamw_1x_linvit.py',
    'mmdet::_base_/default_runtime.py',
]

model = dict(
    backbone=dict(vit=dict(arch='base', drop_path_rate=0.3)),
    neck=dict(in_channels=[768, 768, 768, 768]))
