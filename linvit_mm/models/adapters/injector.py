"""Injector of ViT-Adapter: spatial features flow into the ViT tokens."""
import torch
import torch.utils.checkpoint as cp
from mmcv.cnn import build_norm_layer
from mmengine.model import BaseModule
from torch import nn

from .multi_scale import DeformableInputs, build_deformable_attention


class Injector(BaseModule):
    """``x + gamma * MSDeformAttn(norm(x), norm(c))`` with the ViT tokens as queries.

    Every ViT patch token samples ``num_points`` locations per head in each level of
    the spatial-prior features (strides 8, 16, 32) around its own position. ``gamma``
    (a per-channel layer scale) starts at ``init_values`` = 0 (ViT-Adapter), so at
    initialisation the injector leaves the tokens exactly as the pre-trained ViT
    expects them.

    Args:
        embed_dims (int): token width.
        num_heads (int): deformable-attention heads.
        num_points (int): sampling points per head and level.
        num_levels (int): levels of the spatial features.
        deform_ratio (float): width of the sampled values relative to ``embed_dims``
            (mmcv's ``value_proj_ratio``).
        norm_cfg (dict): token norm of queries and features.
        init_values (float): initial ``gamma``.
        with_cp (bool): gradient checkpointing.
    """

    def __init__(self, embed_dims, num_heads=6, num_points=4, num_levels=3, deform_ratio=1.0,
                 norm_cfg=dict(type='LN', eps=1e-6), init_values=0., with_cp=False,
                 init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        self.with_cp = with_cp
        self.init_values = init_values
        self.query_norm = build_norm_layer(norm_cfg, embed_dims)[1]
        self.feat_norm = build_norm_layer(norm_cfg, embed_dims)[1]
        self.attn = build_deformable_attention(
            embed_dims=embed_dims, num_heads=num_heads, num_levels=num_levels,
            num_points=num_points, dropout=0., batch_first=True,
            value_proj_ratio=deform_ratio)
        self.gamma = nn.Parameter(torch.full((embed_dims, ), float(init_values)))

    def init_weights(self):
        for norm in (self.query_norm, self.feat_norm):
            nn.init.ones_(norm.weight)
            nn.init.zeros_(norm.bias)
        self.attn.init_weights()
        nn.init.constant_(self.gamma, self.init_values)
        self._is_init = True

    def _forward(self, query, feat, inputs: DeformableInputs):
        # mmcv adds `identity` to the attention output; gamma must scale the
        # attention alone, so the identity it adds is zero and the residual is ours.
        attn = self.attn(
            query=self.query_norm(query), value=self.feat_norm(feat),
            identity=query.new_zeros(()), reference_points=inputs.reference_points,
            spatial_shapes=inputs.spatial_shapes, level_start_index=inputs.level_start_index)
        return query + self.gamma * attn

    def forward(self, query, feat, inputs: DeformableInputs):
        """``query`` ``(B, N, C)`` ViT patch tokens, ``feat`` ``(B, M, C)`` multi-level tokens."""
        if self.with_cp and query.requires_grad:
            return cp.checkpoint(self._forward, query, feat, inputs, use_reentrant=False)
        return self._forward(query, feat, inputs)
