# Staged recipe, stage 1: attention alignment of a relu ViT-S to the Softmax DeiT-S
# (docs/staged.md, README.md here): each block's attention alone trains, on the teacher's
# input to that block; no labels.
_base_ = [
    '../../_base_/models/linvit/linvit-small.py',
    '../../_base_/datasets/imagenet_bs128_linvit_224_align.py',
    '../../_base_/schedules/imagenet_bs1024_adamw_5e_align-attn.py',
    'mmpretrain::_base_/default_runtime.py',
]

model = dict(
    _delete_=True,
    type='AttentionAligner',
    backbone=dict(type='LinearViT', arch='small', attn_type='relu', img_size=224),
    teacher={{_base_.distill_hook.teacher}},
    loss_weight=1.0)
