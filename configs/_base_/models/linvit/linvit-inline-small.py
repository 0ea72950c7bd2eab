_base_ = ['./linvit-small.py']

model = dict(backbone=dict(attn_type='inline'))
