# What every Softmax source base (softmax-{size}.py) shares: the distillation hook whose
# frozen teacher is the source itself, a Softmax LinearViT given the source's checkpoint with
# FullCopy. A source base sets the teacher's arch and checkpoint.
# Used by the "-distill" configs: custom_hooks = [{{_base_.distill_hook}}]
distill_hook = dict(
    type='AttentionDistillHook',
    loss_weight=50.0,
    target='output',
    teacher=dict(
        type='LinearViT',
        attn_type='softmax',
        img_size=224,
        init_cfg=dict(type='SoftmaxTransfer', setting='fullcopy')))
