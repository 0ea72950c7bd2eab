# Mask R-CNN + FPN with a ViT-Adapter around LinearViT (configs/detection/README.md). The
# detection configs choose the operator, the size and the classification-stage checkpoint.
_base_ = ['mmdet::_base_/models/mask-rcnn_r50_fpn.py']

custom_imports = dict(
    imports=['linvit_mm.models', 'linvit_mm.engine'], allow_failed_imports=False)

# SyncBN for multi-GPU training; tools/train.py turns it into BN on machines without CUDA.
norm_cfg = dict(type='SyncBN', requires_grad=True)
model = dict(
    backbone=dict(
        _delete_=True,
        type='mmpretrain.LinearViTAdapter',
        vit=dict(arch='small', attn_type='relu', img_size=224, drop_path_rate=0.2),
        conv_inplane=64,
        n_points=4,
        init_values=0.,
        with_cffn=True,
        cffn_ratio=0.25,
        use_extra_extractor=True,
        add_vit_feature=True,
        norm_cfg=norm_cfg,
        with_cp=False,
        pretrained=None,
        checkpoint_prefix='backbone.'),
    neck=dict(in_channels=[384, 384, 384, 384]))
