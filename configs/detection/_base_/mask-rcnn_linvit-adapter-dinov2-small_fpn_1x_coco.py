# Mask R-CNN + FPN, COCO 1x, with a ViT-Adapter around a LinearViT of the dinov2-small source:
# the ViT-Small recipe with the source's arch word (patch size, registers, LayerScale, RoPE;
# the adapter matches a patch-14 grid to its levels in pixels). A config names the attention
# operator and the ImageNet-stage checkpoint of the same operator and source.
_base_ = './mask-rcnn_linvit-adapter-small_fpn_1x_coco.py'

model = dict(backbone=dict(vit=dict(arch='dinov2-small')))
