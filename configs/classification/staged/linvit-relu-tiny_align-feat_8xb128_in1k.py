# Staged recipe, stage 2: feature alignment of the relu ViT-T of stage 1 to the Softmax
# DeiT-T (docs/user_guides/staged.md, README.md here).
_base_ = ['../../_base_/models/linvit/softmax-tiny.py', './_base_/align-feat_8xb128_in1k.py']

stage1_checkpoint = 'work_dirs/linvit-relu-tiny_align-attn_8xb128_in1k/epoch_5.pth'
model = dict(
    backbone=dict(arch='tiny', attn_type='relu', init_cfg=dict(checkpoint=stage1_checkpoint)),
    teacher={{_base_.distill_hook.teacher}})
