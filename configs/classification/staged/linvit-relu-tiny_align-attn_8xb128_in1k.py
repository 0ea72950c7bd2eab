# Staged recipe, stage 1: attention alignment of a relu ViT-T to the Softmax DeiT-T
# (docs/user_guides/staged.md, README.md here).
_base_ = ['../../_base_/models/linvit/softmax-tiny.py', './_base_/align-attn_8xb128_in1k.py']

model = dict(backbone=dict(arch='tiny', attn_type='relu'), teacher={{_base_.distill_hook.teacher}})
