# Staged recipe, stage 3 with LoRA, what every size and operator shares: mmpretrain's
# LoRAModel around the aligned LinearViT (stage 2); the low-rank factors of attn.qkv and
# attn.proj and the head train. tools/model_converters/merge_lora.py folds the factors into
# a plain checkpoint. A leaf inherits a Softmax base (softmax-{size}.py) beside this file and
# sets the ViT's arch, operator and checkpoint and the head's width and initialisation.
_base_ = [
    '../../../_base_/models/linvit/linvit-classifier.py',
    '../../../_base_/datasets/imagenet_bs128_linvit_224.py',
    '../../../_base_/schedules/imagenet_bs1024_adamw_10e_lora.py',
    'mmpretrain::_base_/default_runtime.py',
]

model = dict(
    backbone=dict(
        _delete_=True,
        type='LoRAModel',
        module=dict(type='LinearViT', img_size=224, init_cfg=dict(type='LinearViTCheckpoint')),
        alpha=16,
        rank=8,
        drop_rate=0.0,
        targets=[dict(type='attn.qkv'), dict(type='attn.proj')]))
