# Staged recipe on the demo's data, stage 2 (docs/user_guides/staged.md): the whole relu mini ViT of
# stage 1 matches the Softmax teacher's final normed tokens; no labels, nothing to validate.
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']

stage1_checkpoint = 'work_dirs/linvit-relu-mini_align-attn_1xb24_mini-groups/iter_200.pth'
model = dict(
    _delete_=True,
    type='FeatureAligner',
    backbone=dict(
        type='LinearViT',
        arch={{_base_.mini_arch}},
        attn_type='relu',
        img_size=64,
        patch_size=8,
        init_cfg=dict(type='LinearViTCheckpoint', checkpoint=stage1_checkpoint)),
    teacher={{_base_.distill_hook.teacher}},
    mse_weight=1.0,
    cos_weight=0.0)
val_dataloader = None
val_evaluator = None
val_cfg = None
test_dataloader = None
test_evaluator = None
test_cfg = None
custom_hooks = [dict(type='StagedRecordHook')]
