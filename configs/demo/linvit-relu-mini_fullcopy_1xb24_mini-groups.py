# Demo step 2, setting "fullcopy" (configs/demo/_base_/linvit-relu-mini_mini-groups.py): every
# weight of the teacher's ViT copied, attention included, and no distillation (the recipe
# benchmark's control for fullcopy-distill).
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']

model = dict(backbone=dict(init_cfg=dict(setting='fullcopy')))
