# What a linear ViT starts from and learns from when its source is DINOv2 ViT-L/14 (arch
# 'dinov2-large'), without the model: the base linvit-dinov2-large.py adds the classifier.
# The Softmax ViT that initialises the student (SoftmaxTransfer) and teaches it
# (AttentionDistillHook): the release, from
#   https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth
# (timm's vit_large_patch14_dinov2 state dict works too; docs/transfer.md). Put it here, or
# override per run as for the DeiT sizes (README.md, Configs).
softmax_checkpoint = 'checkpoints/dinov2_vitl14_pretrain.pth'

# Used by the "-distill" configs: custom_hooks = [{{_base_.distill_hook}}]
distill_hook = dict(
    type='AttentionDistillHook',
    loss_weight=50.0,
    target='output',
    teacher=dict(
        type='LinearViT',
        arch='dinov2-large',
        attn_type='softmax',
        img_size=224,
        init_cfg=dict(
            type='SoftmaxTransfer', checkpoint=softmax_checkpoint, setting='fullcopy')))

# Used by the ImageNet "fullcopy" configs, head=dict(init_cfg={{_base_.fullcopy_head_init}}):
# the release is self-supervised and has no classifier to copy, so the head keeps its
# default, zero weights, as with a DeiT checkpoint before its head is copied.
fullcopy_head_init = [dict(type='Constant', layer='Linear', val=0)]
