# Demo step 1: pre-train a small Softmax ViT from scratch on the generated shapes set.
_base_ = [
    './_base_/linvit-mini.py',
    './_base_/mini_imagenet_64.py',
    './_base_/schedule_runtime_mini.py',
]

model = dict(backbone=dict(attn_type='softmax'))
