_base_ = [
    '../../_base_/models/linvit/linvit-small.py',
    './_base_/8xb64_pets.py',
]

model = dict(
    backbone=dict(attn_type='softmax', init_cfg=dict(setting='fullcopy')),
    head=dict(num_classes={{_base_.num_classes}}))
