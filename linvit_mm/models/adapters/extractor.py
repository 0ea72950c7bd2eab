"""Extractor of ViT-Adapter: the ViT tokens flow back into the multi-scale features."""
import torch.utils.checkpoint as cp
from mmcv.cnn import build_norm_layer
from mmcv.cnn.bricks.drop import DropPath
from mmengine.model import BaseModule
from mmengine.model.weight_init import trunc_normal_
from torch import nn

from .multi_scale import DeformableInputs, build_deformable_attention, flatten_maps, split_maps
from .spatial_prior import kaiming_fan_out_


class ConvFFN(BaseModule):
    """``fc2(drop(gelu(dwconv3x3(fc1(x)))))`` over tokens of several grids.

    The 3x3 depthwise conv (one set of weights shared by all levels) runs on each
    level's own grid, so neighbouring cells of one level mix and levels do not.
    """

    def __init__(self, embed_dims, hidden_dims, drop_rate=0., init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        self.fc1 = nn.Linear(embed_dims, hidden_dims)
        self.dwconv = nn.Conv2d(hidden_dims, hidden_dims, 3, padding=1, groups=hidden_dims)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dims, embed_dims)
        self.drop = nn.Dropout(drop_rate)

    def init_weights(self):
        for linear in (self.fc1, self.fc2):
            trunc_normal_(linear.weight, std=.02)
            nn.init.zeros_(linear.bias)
        kaiming_fan_out_(self.dwconv)
        self._is_init = True

    def forward(self, x, grid_shapes):
        x = self.fc1(x)
        x = flatten_maps([self.dwconv(level) for level in split_maps(x, grid_shapes)])
        x = self.drop(self.act(x))
        return self.drop(self.fc2(x))


class Extractor(BaseModule):
    """``c + MSDeformAttn(norm(c), norm(x))``, then ``c + drop_path(ConvFFN(norm(c)))``.

    The multi-scale features (strides 8, 16, 32, one token sequence) are the queries
    and sample the ViT patch tokens (one level) around their own positions.

    Args:
        embed_dims (int): token width.
        num_heads, num_points, deform_ratio: deformable attention, as in the injector.
        num_levels (int): levels of the sampled ViT features (1).
        with_cffn (bool): add the ConvFFN. ``cffn_ratio`` sets its hidden width.
        drop_rate (float): dropout inside the ConvFFN.
        drop_path_rate (float): drop-path on the ConvFFN branch.
        norm_cfg (dict): token norm.
        with_cp (bool): gradient checkpointing.
    """

    def __init__(self, embed_dims, num_heads=6, num_points=4, num_levels=1, deform_ratio=1.0,
                 with_cffn=True, cffn_ratio=0.25, drop_rate=0., drop_path_rate=0.,
                 norm_cfg=dict(type='LN', eps=1e-6), with_cp=False, init_cfg=None):
        super().__init__(init_cfg=init_cfg)
        self.with_cp = with_cp
        self.query_norm = build_norm_layer(norm_cfg, embed_dims)[1]
        self.feat_norm = build_norm_layer(norm_cfg, embed_dims)[1]
        self.attn = build_deformable_attention(
            embed_dims=embed_dims, num_heads=num_heads, num_levels=num_levels,
            num_points=num_points, dropout=0., batch_first=True,
            value_proj_ratio=deform_ratio)
        self.with_cffn = with_cffn
        if with_cffn:
            self.ffn_norm = build_norm_layer(norm_cfg, embed_dims)[1]
            self.ffn = ConvFFN(embed_dims, int(embed_dims * cffn_ratio), drop_rate=drop_rate)
            self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else nn.Identity()

    def init_weights(self):
        norms = [self.query_norm, self.feat_norm] + ([self.ffn_norm] if self.with_cffn else [])
        for norm in norms:
            nn.init.ones_(norm.weight)
            nn.init.zeros_(norm.bias)
        self.attn.init_weights()
        if self.with_cffn:
            self.ffn.init_weights()
        self._is_init = True

    def _forward(self, query, feat, inputs: DeformableInputs, query_shapes):
        # mmcv adds `identity` (the un-normalised query) to the attention output:
        # that is the extractor's residual connection.
        query = self.attn(
            query=self.query_norm(query), value=self.feat_norm(feat), identity=query,
            reference_points=inputs.reference_points, spatial_shapes=inputs.spatial_shapes,
            level_start_index=inputs.level_start_index)
        if self.with_cffn:
            query = query + self.drop_path(self.ffn(self.ffn_norm(query), query_shapes))
        return query

    def forward(self, query, feat, inputs: DeformableInputs, query_shapes):
        """``query`` ``(B, M, C)`` multi-level tokens on ``query_shapes``; ``feat`` ViT tokens."""
        if self.with_cp and query.requires_grad:
            return cp.checkpoint(self._forward, query, feat, inputs, query_shapes,
                                 use_reentrant=False)
        return self._forward(query, feat, inputs, query_shapes)
