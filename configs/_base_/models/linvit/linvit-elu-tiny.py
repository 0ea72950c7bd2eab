_base_ = ['./linvit-tiny.py']

model = dict(backbone=dict(attn_type='elu'))
