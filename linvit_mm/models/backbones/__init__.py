from .linear_vit import LinearViT, LinearViTLayer, sincos_pos_embed

__all__ = ['LinearViT', 'LinearViTLayer', 'sincos_pos_embed']
