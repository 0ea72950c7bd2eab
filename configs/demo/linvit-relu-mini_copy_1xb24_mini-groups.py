# Demo step 2, setting "copy" (configs/demo/_base_/linvit-relu-mini_mini-groups.py).
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']

model = dict(backbone=dict(init_cfg=dict(setting='copy')))
