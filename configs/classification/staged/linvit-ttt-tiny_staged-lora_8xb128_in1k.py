# Staged recipe, stage 3 with LoRA on the aligned ttt ViT-T of stage 2 (docs/user_guides/staged.md,
# README.md here); the head starts from the DeiT-T head.
_base_ = ['../../_base_/models/linvit/softmax-tiny.py', './_base_/staged-lora_8xb128_in1k.py']

stage2_checkpoint = 'work_dirs/linvit-ttt-tiny_align-feat_8xb128_in1k/epoch_10.pth'
model = dict(
    backbone=dict(
        module=dict(arch='tiny', attn_type='ttt', init_cfg=dict(checkpoint=stage2_checkpoint))),
    head=dict(in_channels=192, init_cfg={{_base_.fullcopy_head_init}}))
