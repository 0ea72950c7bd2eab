# Demo step 2, setting "fullcopy-distill" (configs/demo/_base_/linvit-relu-mini_mini-groups.py).
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']

model = dict(backbone=dict(init_cfg=dict(setting='fullcopy')))
custom_hooks = [{{_base_.distill_hook}}]
