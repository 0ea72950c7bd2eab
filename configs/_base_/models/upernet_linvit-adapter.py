# UperNet with a ViT-Adapter around LinearViT (configs/segmentation/README.md). The
# segmentation configs choose the operator, the size and the classification-stage checkpoint.
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
        type='mmpretrain.LinearViTAdapter',
        vit=dict(arch='small', attn_type='relu', img_size=224, drop_path_rate=0.2),
        conv_inplane=64,
        n_points=4,
        init_values=0.,
        with_cffn=True,
        cffn_ratio=0.25,
        use_extra_extractor=True,
        add_vit_feature=True,
        vit_feature_mode='per_interaction',
        norm_cfg=norm_cfg,
        with_cp=False,
        pretrained=None,
        checkpoint_prefix='backbone.'),
    decode_head=dict(in_channels=[384, 384, 384, 384], num_classes=150, norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=384, num_classes=150, norm_cfg=norm_cfg),
    # the recipe tests with a sliding window of 512 x 512 crops
    test_cfg=dict(mode='slide', crop_size=(512, 512), stride=(341, 341)))
