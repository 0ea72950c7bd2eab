_base_ = './_base_/mask-rcnn_linvit-plain-base_fpn_1x_coco.py'

# The ImageNet-stage checkpoint: what tools/train.py writes for
#   configs/classification/imagenet/linvit-softmax-base_fullcopy_32xb128_in1k.py
linvit_checkpoint = 'work_dirs/linvit-softmax-base_fullcopy_32xb128_in1k/epoch_300.pth'
model = dict(
    backbone=dict(
        vit=dict(
            attn_type='softmax',
            window_size=14,
            window_block_indexes=[0, 1, 3, 4, 6, 7, 9, 10]),
        pretrained=linvit_checkpoint))
