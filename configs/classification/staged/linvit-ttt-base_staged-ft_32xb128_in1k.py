# Staged recipe, stage 3: supervised fine-tuning of the aligned ttt ViT-B (stage 2),
# every weight trained; the head starts from the DeiT-B head (docs/user_guides/staged.md).
_base_ = [
    '../../_base_/models/linvit/linvit-base.py',
    '../../_base_/datasets/imagenet_bs128_linvit_224.py',
    '../../_base_/schedules/imagenet_bs4096_adamw_30e_staged-ft.py',
    'mmpretrain::_base_/default_runtime.py',
]

stage2_checkpoint = 'work_dirs/linvit-ttt-base_align-feat_8xb128_in1k/epoch_10.pth'
model = dict(
    backbone=dict(
        attn_type='ttt',
        init_cfg=dict(_delete_=True, type='LinearViTCheckpoint', checkpoint=stage2_checkpoint)),
    head=dict(init_cfg={{_base_.fullcopy_head_init}}))
