_base_ = [
    '../../_base_/models/linvit/linvit-base.py',
    './_base_/32xb128_in1k.py',
]

model = dict(backbone=dict(attn_type='relu', init_cfg=dict(setting='random')))
