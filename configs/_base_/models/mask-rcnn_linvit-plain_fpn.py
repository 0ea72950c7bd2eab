# Mask R-CNN + FPN on a plain LinearViT: ViT-Adapter's plain-ViT baseline (the tokens after
# the last block of each quarter, a LayerNorm each, a deconv / identity / max-pool pyramid;
# configs/detection/README.md). The detection configs choose the operator, the size, the
# windows and the classification-stage checkpoint.
_base_ = ['mmdet::_base_/models/mask-rcnn_r50_fpn.py']

custom_imports = dict(
    imports=['linvit_mm.models', 'linvit_mm.engine'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='mmpretrain.LinearViTPlainPyramid',
        vit=dict(arch='small', attn_type='relu', img_size=224, drop_path_rate=0.1),
        norm_cfg=dict(type='GN', num_groups=32, requires_grad=True),
        with_cp=False,
        pretrained=None,
        checkpoint_prefix='backbone.'),
    neck=dict(in_channels=[384, 384, 384, 384]))
