# UperNet on a plain LinearViT: ViT-Adapter's plain-ViT baseline (the tokens after the last
# block of each quarter, a LayerNorm each, a deconv / identity / max-pool pyramid;
# configs/segmentation/README.md). The segmentation configs choose the operator, the size
# and the classification-stage checkpoint.
_base_ = ['mmseg::_base_/models/upernet_r50.py']

custom_imports = dict(
    imports=['linvit_mm.models', 'linvit_mm.engine'], allow_failed_imports=False)

# SyncBN for multi-GPU training; tools/train.py turns it into BN on machines without CUDA.
norm_cfg = dict(type='SyncBN', requires_grad=True)
model = dict(
    pretrained=None,
    # training batches are padded to the 512 x 512 crop size
    data_preprocessor=dict(size=(512, 512)),
    backbone=dict(
        _delete_=True,
        type='mmpretrain.LinearViTPlainPyramid',
        vit=dict(arch='small', attn_type='relu', img_size=224, drop_path_rate=0.1),
        norm_cfg=dict(type='GN', num_groups=32, requires_grad=True),
        with_cp=False,
        pretrained=None,
        checkpoint_prefix='backbone.'),
    decode_head=dict(in_channels=[384, 384, 384, 384], num_classes=150, norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=384, num_classes=150, norm_cfg=norm_cfg),
    # the recipe tests with a sliding window of 512 x 512 crops
    test_cfg=dict(mode='slide', crop_size=(512, 512), stride=(341, 341)))
