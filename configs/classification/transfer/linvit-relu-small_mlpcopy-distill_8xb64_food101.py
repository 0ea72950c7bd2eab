_base_ = [
    '../../_base_/models/linvit/linvit-relu-small.py',
    '../../_base_/datasets/food101_bs64_linvit_224.py',
    '../../_base_/schedules/transfer_bs512_adamw_300e_linvit.py',
    'mmpretrain::_base_/default_runtime.py',
]

model = dict(
    backbone=dict(init_cfg=dict(setting='mlpcopy')),
    head=dict(num_classes=101))
custom_hooks = [{{_base_.distill_hook}}]
