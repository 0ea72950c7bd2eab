# Staged recipe, stage 3 with LoRA: mmpretrain's LoRAModel around the aligned relu ViT-B
# (stage 2); the low-rank factors of attn.qkv and attn.proj and the head train.
# tools/model_converters/merge_lora.py folds the factors into a plain checkpoint.
_base_ = [
    '../../_base_/models/linvit/linvit-base.py',
    '../../_base_/datasets/imagenet_bs128_linvit_224.py',
    '../../_base_/schedules/imagenet_bs1024_adamw_10e_lora.py',
    'mmpretrain::_base_/default_runtime.py',
]

stage2_checkpoint = 'work_dirs/linvit-relu-base_align-feat_8xb128_in1k/epoch_10.pth'
model = dict(
    backbone=dict(
        _delete_=True,
        type='LoRAModel',
        module=dict(
            type='LinearViT',
            arch='base',
            attn_type='relu',
            img_size=224,
            init_cfg=dict(type='LinearViTCheckpoint', checkpoint=stage2_checkpoint)),
        alpha=16,
        rank=8,
        drop_rate=0.0,
        targets=[dict(type='attn.qkv'), dict(type='attn.proj')]),
    head=dict(init_cfg={{_base_.fullcopy_head_init}}))
