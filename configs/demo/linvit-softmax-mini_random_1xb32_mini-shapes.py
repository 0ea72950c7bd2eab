# Demo step 1: pre-train a small Softmax ViT from scratch on a generated shapes set
# (150 images a class, written by tools/demo.py to data/mini/imagenet_large).
_base_ = [
    './_base_/linvit-mini.py',
    './_base_/mini_imagenet_64.py',
    './_base_/schedule_runtime_mini.py',
]

data_root = 'data/mini/imagenet_large'
train_dataloader = dict(dataset=dict(data_root=data_root))
val_dataloader = dict(dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
model = dict(backbone=dict(attn_type='softmax'))

max_iters = 1500
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, end=60),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=False, begin=60, end=max_iters),
]
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
default_hooks = dict(checkpoint=dict(interval=max_iters))
