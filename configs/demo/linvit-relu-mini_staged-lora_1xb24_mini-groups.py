# Staged recipe on the demo's data, stage 3 with LoRA (docs/user_guides/staged.md): mmpretrain's
# LoRAModel around the aligned relu mini ViT of stage 2; the low-rank factors of attn.qkv and
# attn.proj and the head train. tools/model_converters/merge_lora.py then writes a plain
# checkpoint.
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']

stage2_checkpoint = 'work_dirs/linvit-relu-mini_align-feat_1xb24_mini-groups/iter_200.pth'
model = dict(
    backbone=dict(
        _delete_=True,
        type='LoRAModel',
        module=dict(
            type='LinearViT',
            arch={{_base_.mini_arch}},
            attn_type='relu',
            img_size=64,
            patch_size=8,
            init_cfg=dict(type='LinearViTCheckpoint', checkpoint=stage2_checkpoint)),
        alpha=16,
        rank=8,
        drop_rate=0.0,
        targets=[dict(type='attn.qkv'), dict(type='attn.proj')]))
custom_hooks = [dict(type='LoRATargetsHook'), dict(type='StagedRecordHook')]
