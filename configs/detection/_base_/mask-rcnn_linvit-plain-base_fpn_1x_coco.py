# Mask R-CNN + FPN, COCO 1x, on a plain LinearViT-Base with ViT-Adapter's simple pyramid: the
# paper's dense protocol (its plain-ViT baseline of ViT-Adapter; drop path 0.1 as there). A
# config names the attention operator (Softmax with 14 x 14 windows in 8 of the 12 blocks)
# and the ImageNet-stage checkpoint of the same operator and size; see README.md in the
# folder above.
_base_ = [
    '../../_base_/models/mask-rcnn_linvit-plain_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    '../../_base_/schedules/coco_adamw_1x_linvit.py',
    'mmdet::_base_/default_runtime.py',
]

model = dict(
    backbone=dict(vit=dict(arch='base', drop_path_rate=0.1)),
    neck=dict(in_channels=[768, 768, 768, 768]))
