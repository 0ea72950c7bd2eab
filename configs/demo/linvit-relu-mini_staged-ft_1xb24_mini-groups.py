# Staged recipe on the demo's data, stage 3 (docs/user_guides/staged.md): supervised fine-tuning
# of the
# aligned relu mini ViT of stage 2 on the shape groups, every weight trained.
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']

stage2_checkpoint = 'work_dirs/linvit-relu-mini_align-feat_1xb24_mini-groups/iter_200.pth'
model = dict(
    backbone=dict(
        init_cfg=dict(_delete_=True, type='LinearViTCheckpoint', checkpoint=stage2_checkpoint)))
