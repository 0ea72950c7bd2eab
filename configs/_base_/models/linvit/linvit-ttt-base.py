_base_ = ['./linvit-base.py']

model = dict(backbone=dict(attn_type='ttt'))
