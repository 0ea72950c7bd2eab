# Staged recipe, stage 1: attention alignment of a ttt ViT-S to the Softmax DeiT-S
# (docs/user_guides/staged.md, README.md here).
_base_ = ['../../_base_/models/linvit/softmax-small.py', './_base_/align-attn_8xb128_in1k.py']

model = dict(backbone=dict(arch='small', attn_type='ttt'), teacher={{_base_.distill_hook.teacher}})
