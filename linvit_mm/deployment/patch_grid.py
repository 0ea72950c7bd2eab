"""The patch grid of the image a timm ViT runs on, for its attention layers."""


class PatchGrid:
    """Where a timm ``VisionTransformer`` converted from a LinearViT keeps the patch grid of
    the images it is running on.

    timm's blocks call ``attn(x, attn_mask=None, is_causal=False)``: tokens only, while MHLA
    and ViT^3 (and the conditional position encoding, and RoPE) need the grid. ``N`` alone
    does not give it (12 patches are 3 x 4 or 4 x 3). The model's own patch embedding knows
    it: :meth:`attach` registers a forward pre-hook on ``model.patch_embed`` that records
    ``patch_embed.dynamic_feat_size(image size)`` (timm's grid for that image: the fixed grid,
    or with ``dynamic_img_size`` any image's) before the blocks run, and every attention
    layer of the model reads it through :meth:`of`, which also checks that the tokens it is
    given hold that grid after the model's prefix tokens (class token, registers).
    """

    def __init__(self, num_prefix_tokens):
        self.num_prefix_tokens = num_prefix_tokens
        self.hw_shape = None

    def attach(self, model):
        """Record the grid whenever ``model.patch_embed`` embeds images; the hook's handle."""
        return model.patch_embed.register_forward_pre_hook(self._record)

    def _record(self, patch_embed, args):
        self.hw_shape = tuple(patch_embed.dynamic_feat_size(tuple(args[0].shape[-2:])))

    def of(self, tokens):
        """The ``(H, W)`` grid of ``(B, N, C)`` tokens of the image being embedded."""
        if self.hw_shape is None:
            raise RuntimeError('no patch grid recorded: the attention layers of a converted '
                               'model take the grid of the images the model embeds, so call '
                               'the VisionTransformer (or its patch_embed first), not a block '
                               'on its own')
        H, W = self.hw_shape
        if tokens.shape[1] != self.num_prefix_tokens + H * W:
            raise ValueError(f'{tokens.shape[1]} tokens do not hold {self.num_prefix_tokens} '
                             f'prefix tokens and the {H}x{W} grid of the last embedded image')
        return self.hw_shape
