# What a linear ViT-Small starts from and learns from, without the model: the
# size base linvit-small.py adds the classifier, and the staged-recipe configs (whose
# model is an aligner) inherit this file alone.
# The Softmax ViT that initialises the student (SoftmaxTransfer) and teaches it
# (AttentionDistillHook): the official DeiT-Small release,
#   https://dl.fbaipublicfiles.com/deit/deit_small_patch16_224-cd65a155.pth
# (any format of docs/transfer.md works). Put it here, or override per run with
#   --cfg-options model.backbone.init_cfg.checkpoint=PATH \
#                 custom_hooks.0.teacher.init_cfg.checkpoint=PATH \
#                 model.head.init_cfg.1.checkpoint=PATH  # the ImageNet FullCopy head
softmax_checkpoint = 'checkpoints/deit_small_patch16_224-cd65a155.pth'

# Used by the "-distill" configs: custom_hooks = [{{_base_.distill_hook}}]
distill_hook = dict(
    type='AttentionDistillHook',
    loss_weight=50.0,
    target='output',
    teacher=dict(
        type='LinearViT',
        arch='small',
        attn_type='softmax',
        img_size=224,
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint=softmax_checkpoint, setting='fullcopy')))

# Used by the ImageNet "fullcopy" configs, head=dict(init_cfg={{_base_.fullcopy_head_init}}):
# FullCopy copies every tensor whose name and shape match, and on ImageNet-1K that includes
# the 1000-class head. The head's own default (zero weights) comes first, as the copy
# replaces only what it copies.
fullcopy_head_init = [
    dict(type='Constant', layer='Linear', val=0),
    dict(type='SoftmaxTransfer', checkpoint=softmax_checkpoint, setting='fullcopy',
         prefix='head.'),
]
