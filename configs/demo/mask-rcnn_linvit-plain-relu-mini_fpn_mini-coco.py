# Demo step 4a beside the adapter: the same Mask R-CNN, data and schedule on the plain-ViT
# pyramid (ViT-Adapter's plain baseline) instead of the adapter.
_base_ = ['./mask-rcnn_linvit-adapter-relu-mini_fpn_mini-coco.py', './_base_/plain-mini.py']

model = dict(backbone={{_base_.mini_plain}})
