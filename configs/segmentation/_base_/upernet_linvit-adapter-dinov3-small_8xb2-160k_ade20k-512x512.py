# UperNet, ADE20K 160k, with a ViT-Adapter around a LinearViT of the dinov3-small source: the
# ViT-Small recipe with the source's arch word (patch size, registers, LayerScale, RoPE; the
# adapter matches a patch-14 grid to its levels in pixels). A config names the attention
# operator and the ImageNet-stage checkpoint of the same operator and source.
_base_ = './upernet_linvit-adapter-small_8xb2-160k_ade20k-512x512.py'

model = dict(backbone=dict(vit=dict(arch='dinov3-small')))
