# Staged recipe, stage 2: feature alignment of the relu ViT-S of stage 1 to the Softmax
# DeiT-S (docs/user_guides/staged.md, README.md here).
_base_ = ['../../_base_/models/linvit/softmax-small.py', './_base_/align-feat_8xb128_in1k.py']

stage1_checkpoint = 'work_dirs/linvit-relu-small_align-attn_8xb128_in1k/epoch_5.pth'
model = dict(
    backbone=dict(arch='small', attn_type='relu', init_cfg=dict(checkpoint=stage1_checkpoint)),
    teacher={{_base_.distill_hook.teacher}})
