# Demo step 4b beside the adapter: the same UperNet, data and schedule on the plain-ViT pyramid
# (ViT-Adapter's plain baseline) instead of the adapter.
_base_ = ['./upernet_linvit-adapter-relu-mini_mini-ade.py', './_base_/plain-mini.py']

model = dict(backbone={{_base_.mini_plain}})
