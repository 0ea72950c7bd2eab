"""A timm block for operators with a position encoding of the block input."""
from timm.models.vision_transformer import Block


class PositionEncodingBlock(Block):
    """timm's ``Block`` preceded by the operator's ``encode_position`` of its input.

    ViT^3 (``ttt``) adds a depthwise-conv position encoding to the residual stream before
    the block's first norm, ``x = x + cpe(x); x = x + attn(norm1(x)); ...``, which the
    attention layer alone cannot do (it gets ``norm1(x)`` and its result is added to the
    unencoded ``x``). This block is the ``block_fn`` of such models; the encoding's
    parameters stay with the operator (``attn.cpe``).
    """

    def forward(self, x, attn_mask=None, is_causal=False):
        return super().forward(self.attn.encode_position(x), attn_mask=attn_mask,
                               is_causal=is_causal)
