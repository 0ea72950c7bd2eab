_base_ = [
    '../../_base_/models/linvit/linvit-small.py',
    './_base_/8xb64_food101.py',
]

model = dict(
    backbone=dict(attn_type='relu', init_cfg=dict(setting='mlpcopy')),
    head=dict(num_classes={{_base_.num_classes}}))
custom_hooks = [{{_base_.distill_hook}}]
