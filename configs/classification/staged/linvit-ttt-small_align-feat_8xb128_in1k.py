# Staged recipe, stage 2: feature alignment of the ttt ViT-S of stage 1 to the Softmax
# DeiT-S: the whole student matches the teacher's final normed tokens (docs/staged.md).
_base_ = [
    '../../_base_/models/linvit/linvit-small.py',
    '../../_base_/datasets/imagenet_bs128_linvit_224_align.py',
    '../../_base_/schedules/imagenet_bs1024_adamw_10e_align-feat.py',
    'mmpretrain::_base_/default_runtime.py',
]

stage1_checkpoint = 'work_dirs/linvit-ttt-small_align-attn_8xb128_in1k/epoch_5.pth'
model = dict(
    _delete_=True,
    type='FeatureAligner',
    backbone=dict(
        type='LinearViT',
        arch='small',
        attn_type='ttt',
        img_size=224,
        init_cfg=dict(type='LinearViTCheckpoint', checkpoint=stage1_checkpoint)),
    teacher={{_base_.distill_hook.teacher}},
    mse_weight=1.0,
    cos_weight=0.0)
