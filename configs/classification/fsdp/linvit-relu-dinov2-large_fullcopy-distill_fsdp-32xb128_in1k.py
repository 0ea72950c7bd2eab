_base_ = [
    '../../_base_/models/linvit/linvit-dinov2-large.py',
    './_base_/fsdp_32xb128_in1k.py',
]

model = dict(
    backbone=dict(attn_type='relu', init_cfg=dict(setting='fullcopy')),
    head=dict(init_cfg={{_base_.fullcopy_head_init}}))
custom_hooks = [{{_base_.distill_hook}}]
