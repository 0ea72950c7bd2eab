# Staged recipe, stage 1: attention alignment of a relu ViT-B to the Softmax DeiT-B
# (docs/user_guides/staged.md, README.md here).
_base_ = ['../../_base_/models/linvit/softmax-base.py', './_base_/align-attn_8xb128_in1k.py']

model = dict(backbone=dict(arch='base', attn_type='relu'), teacher={{_base_.distill_hook.teacher}})
