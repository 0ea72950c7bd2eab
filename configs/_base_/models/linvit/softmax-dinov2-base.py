# What a linear ViT starts from and learns from when its source is DINOv2 ViT-B/14 (arch
# 'dinov2-base'), without the model: the base linvit-dinov2-base.py adds the classifier.
# The Softmax ViT that initialises the student (SoftmaxTransfer) and teaches it
# (AttentionDistillHook): the release, from
#   https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/dinov2_vitb14_pretrain.pth
# (timm's vit_base_patch14_dinov2 state dict works too; docs/user_guides/transfer.md). Put it
# here, or override per run as for the DeiT sizes (README.md, Configs).
_base_ = ['./softmax-teacher.py']

softmax_checkpoint = 'checkpoints/dinov2_vitb14_pretrain.pth'

# The teacher of the "-distill" configs (softmax-teacher.py): this source, Softmax, FullCopy.
distill_hook = dict(teacher=dict(arch='dinov2-base', init_cfg=dict(checkpoint=softmax_checkpoint)))

# Used by the ImageNet "fullcopy" configs, head=dict(init_cfg={{_base_.fullcopy_head_init}}):
# the release is self-supervised and has no classifier to copy, so the head keeps its
# default, zero weights, as with a DeiT checkpoint before its head is copied.
fullcopy_head_init = [dict(type='Constant', layer='Linear', val=0)]
