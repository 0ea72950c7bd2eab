# What a linear ViT-Tiny starts from and learns from, without the model: the
# size base linvit-tiny.py adds the classifier, and the staged-recipe configs (whose
# model is an aligner) inherit this file alone.
# The Softmax ViT that initialises the student (SoftmaxTransfer) and teaches it
# (AttentionDistillHook): the official DeiT-Tiny release,
#   https://dl.fbaipublicfiles.com/deit/deit_tiny_patch16_224-a1311bcf.pth
# (any format of docs/user_guides/transfer.md works). Put it here, or override per run with
#   --cfg-options model.backbone.init_cfg.checkpoint=PATH \
#                 custom_hooks.0.teacher.init_cfg.checkpoint=PATH \
#                 model.head.init_cfg.1.checkpoint=PATH  # the ImageNet FullCopy head
_base_ = ['./softmax-teacher.py']

softmax_checkpoint = 'checkpoints/deit_tiny_patch16_224-a1311bcf.pth'

# The teacher of the "-distill" configs (softmax-teacher.py): this source, Softmax, FullCopy.
distill_hook = dict(teacher=dict(arch='tiny', init_cfg=dict(checkpoint=softmax_checkpoint)))

# Used by the ImageNet "fullcopy" configs, head=dict(init_cfg={{_base_.fullcopy_head_init}}):
# FullCopy copies every tensor whose name and shape match, and on ImageNet-1K that includes
# the 1000-class head. The head's own default (zero weights) comes first, as the copy
# replaces only what it copies.
fullcopy_head_init = [
    dict(type='Constant', layer='Linear', val=0),
    dict(type='SoftmaxTransfer', checkpoint=softmax_checkpoint, setting='fullcopy',
         prefix='head.'),
]
