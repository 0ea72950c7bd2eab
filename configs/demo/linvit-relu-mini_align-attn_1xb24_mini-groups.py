# Staged recipe on the demo's data, stage 1 (docs/user_guides/staged.md): attention alignment of
# the relu
# mini ViT to the demo's Softmax teacher. Each block's attention alone trains, on the
# teacher's input to that block; labels are not used and there is nothing to validate.
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']

model = dict(
    _delete_=True,
    type='AttentionAligner',
    backbone=dict(
        type='LinearViT', arch={{_base_.mini_arch}}, attn_type='relu', img_size=64,
        patch_size=8),
    teacher={{_base_.distill_hook.teacher}})
# Blocks stay independent: no weight decay (LoLCATs) and no clip by the global norm.
optim_wrapper = dict(optimizer=dict(weight_decay=0.0), clip_grad=None)
val_dataloader = None
val_evaluator = None
val_cfg = None
test_dataloader = None
test_evaluator = None
test_cfg = None
custom_hooks = [dict(type='StagedRecordHook')]
