_base_ = './_base_/upernet_linvit-plain-base_8xb2-160k_ade20k-512x512.py'

# The ImageNet-stage checkpoint: what tools/train.py writes for
#   configs/classification/imagenet/linvit-ttt-base_fullcopy-distill_32xb128_in1k.py
linvit_checkpoint = 'work_dirs/linvit-ttt-base_fullcopy-distill_32xb128_in1k/epoch_300.pth'
model = dict(backbone=dict(vit=dict(attn_type='ttt'), pretrained=linvit_checkpoint))
