"""One interaction of ViT-Adapter: inject, run a group of ViT blocks, extract."""
import torch
from mmengine.model import BaseModule, ModuleList

from .extractor import Extractor
from .injector import Injector


class InteractionBlock(BaseModule):
    """Injector -> ViT blocks ``[start, end]`` -> extractor (+ extra extractors).

    The ViT blocks are not owned here (they stay in the wrapped ViT, so their
    parameter names match the classification checkpoint); ``forward`` receives them.
    A class token, when the ViT has one, skips the injector and the extractors and is
    re-attached in front of the patch tokens for the ViT blocks only.

    Args:
        embed_dims (int): token width.
        num_heads, num_points, deform_ratio, init_values, with_cffn, cffn_ratio,
            drop_rate, drop_path_rate, norm_cfg, with_cp: see :class:`Injector`
            and :class:`Extractor`.
        num_levels (int): levels of the spatial features seen by the injector.
        num_extra_extractors (int): extractors after the main one (ViT-Adapter puts
            two in the last interaction).
    """

    def __init__(self, embed_dims, num_heads=6, num_points=4, num_levels=3, deform_ratio=1.0,
                 init_values=0., with_cffn=True, cffn_ratio=0.25, drop_rate=0.,
                 drop_path_rate=0., norm_cfg=dict(type='LN', eps=1e-6),
                 num_extra_extractors=0, with_cp=False, init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        self.injector = Injector(
            embed_dims, num_heads=num_heads, num_points=num_points, num_levels=num_levels,
            deform_ratio=deform_ratio, norm_cfg=norm_cfg, init_values=init_values,
            with_cp=with_cp)
        extractor_cfg = dict(
            num_heads=num_heads, num_points=num_points, num_levels=1,
            deform_ratio=deform_ratio, with_cffn=with_cffn, cffn_ratio=cffn_ratio,
            drop_rate=drop_rate, drop_path_rate=drop_path_rate, norm_cfg=norm_cfg,
            with_cp=with_cp)
        self.extractor = Extractor(embed_dims, **extractor_cfg)
        self.extra_extractors = ModuleList(
            [Extractor(embed_dims, **extractor_cfg) for _ in range(num_extra_extractors)])

    def init_weights(self):
        self.injector.init_weights()
        for extractor in [self.extractor, *self.extra_extractors]:
            extractor.init_weights()
        self._is_init = True

    def forward(self, x, c, cls_tokens, vit_layers, vit_shape, level_shapes, inject_inputs,
                extract_inputs):
        """One interaction.

        Args:
            x (Tensor): ``(B, h*w, C)`` ViT patch tokens on ``vit_shape``.
            c (Tensor): ``(B, M, C)`` spatial tokens on ``level_shapes``.
            cls_tokens (Tensor | None): ``(B, k, C)`` tokens that lead the ViT sequence.
            vit_layers (Sequence[nn.Module]): ViT blocks, each called as
                ``layer(tokens, vit_shape)``.
            inject_inputs, extract_inputs (DeformableInputs): see ``deformable_inputs``.

        Returns:
            tuple: updated ``x``, ``c`` and ``cls_tokens``.
        """
        x = self.injector(x, c, inject_inputs)
        num_extra = 0
        if cls_tokens is not None:
            num_extra = cls_tokens.shape[1]
            x = torch.cat((cls_tokens, x), dim=1)
        for layer in vit_layers:
            x = layer(x, vit_shape)
        if cls_tokens is not None:
            cls_tokens, x = x[:, :num_extra], x[:, num_extra:]
        c = self.extractor(c, x, extract_inputs, level_shapes)
        for extractor in self.extra_extractors:
            c = extractor(c, x, extract_inputs, level_shapes)
        return x, c, cls_tokens
