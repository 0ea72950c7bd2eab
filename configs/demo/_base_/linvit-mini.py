# A ViT small enough to train in a minute on 2 CPU cores (4 blocks, width 96, 3 heads of
# 32, patch 8 on 64 x 64 images: 64 tokens). Same classifier, initialiser and
# distillation hook as the ImageNet configs; only the sizes differ.
_base_ = ['../../_base_/models/linvit/linvit-classifier.py']

mini_arch = dict(embed_dims=96, num_layers=4, num_heads=3, feedforward_channels=384)
# The Softmax teacher that the demo pre-trains on the shapes set, i.e. what
#   tools/train.py configs/demo/linvit-softmax-mini_random_1xb32_mini-shapes.py
# writes (the demo passes its own path with --cfg-options).
softmax_checkpoint = 'work_dirs/linvit-softmax-mini_random_1xb32_mini-shapes/iter_1500.pth'

model = dict(
    backbone=dict(
        arch=dict(_delete_=True, **mini_arch),  # replaces the base's arch name
        img_size=64,
        patch_size=8,
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint=softmax_checkpoint, setting='random')),
    head=dict(num_classes=6, in_channels=96))

distill_hook = dict(
    type='AttentionDistillHook',
    loss_weight=50.0,
    target='output',
    teacher=dict(
        type='LinearViT',
        arch=mini_arch,
        attn_type='softmax',
        img_size=64,
        patch_size=8,
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint=softmax_checkpoint, setting='fullcopy')))
