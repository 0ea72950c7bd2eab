"""LinearViT's absolute position embedding: fixed sin-cos for any grid, or learned for the
training grid and resampled (timm's way) for others and for checkpoints of another grid."""
import math

import torch
from torch import nn

from ...utils.tracing import eager_cache, is_tracing


def sincos_pos_embed(hw_shape, embed_dims, temperature=10000., device=None, dtype=None):
    """Fixed 2D sin-cos position embedding ``(1, H*W, C)`` for any grid (MAE / MoCo v3 form).

    Half the channels encode the row, half the column, each as sin and cos of
    ``pos / temperature**(i / (C/4))``; computed for the grid at hand, so there is
    nothing to interpolate when the resolution changes.
    """
    if embed_dims % 4 != 0:
        raise ValueError(f'sin-cos position embedding needs embed_dims divisible by 4, '
                         f'got {embed_dims}')
    h, w = hw_shape
    quarter = embed_dims // 4
    omega = 1. / temperature**(torch.arange(quarter, dtype=torch.float64) / quarter)
    rows = torch.arange(h, dtype=torch.float64)[:, None].expand(h, w).reshape(-1)
    cols = torch.arange(w, dtype=torch.float64)[None, :].expand(h, w).reshape(-1)
    row_angles = rows[:, None] * omega[None]
    col_angles = cols[:, None] * omega[None]
    embed = torch.cat([col_angles.sin(), col_angles.cos(), row_angles.sin(), row_angles.cos()], 1)
    return embed.unsqueeze(0).to(device=device, dtype=dtype or torch.get_default_dtype())


@eager_cache(maxsize=16)
def _cached_sincos_pos_embed(hw_shape, embed_dims, device, dtype):
    # Built in float64 with a sin/cos per element on every forward, it took about a tenth
    # of a ViT-S block's time on a CPU at 224 px (0.3-0.7 ms). One entry per (grid, width,
    # device, dtype) covers a run's few sizes. Callers only read it (the tokens get
    # ``x + pos``), so sharing one tensor is safe.
    return sincos_pos_embed(hw_shape, embed_dims, device=device, dtype=dtype)


class PositionEmbeddingMixin:
    """``LinearViT``'s extra tokens and position embedding, and how they join the patches.

    The model sets ``embed_dims``, ``patch_embed``, ``patch_resolution``, ``with_cls_token``,
    ``num_register_tokens``, ``pos_embed_type``, ``no_embed_class``,
    ``pos_embed_extra_tokens``, ``interpolate_mode``, ``pos_embed_antialias``,
    ``drop_after_pos`` and ``pre_norm``.
    """

    def _build_extra_tokens_and_pos_embed(self, num_patches):
        self.cls_token = (nn.Parameter(torch.zeros(1, 1, self.embed_dims))
                          if self.with_cls_token else None)
        self.register_tokens = (
            nn.Parameter(torch.zeros(1, self.num_register_tokens, self.embed_dims))
            if self.num_register_tokens else None)
        if self.pos_embed_type == 'learned':
            self.pos_embed = nn.Parameter(
                torch.zeros(1, num_patches + self.pos_embed_extra_tokens, self.embed_dims))
            self._register_load_state_dict_pre_hook(self._resize_pos_embed_on_load)
        else:
            self.pos_embed = None

    def embed(self, x):
        """Images ``(B, 3, H, W)`` -> tokens (class token, registers, patches) and the grid.

        With ``embed`` and the blocks of ``layers`` (each called as
        ``layer(tokens, hw_shape)``), a wrapper such as the ViT-Adapter runs the
        backbone block by block.
        """
        x, hw_shape = self.patch_embed(x)
        extras = [token.expand(x.shape[0], -1, -1)
                  for token in (self.cls_token, self.register_tokens) if token is not None]
        if not extras:
            # PatchEmbed returns a transposed view of its NCHW output. Elementwise ops keep
            # their input's layout, so without an extra token (whose concatenation copies)
            # the whole residual stream would stay transposed, and every LayerNorm, forward
            # and backward, would copy it back to contiguous.
            x = x.contiguous()
        pos_embed = self.position_embedding(hw_shape, x)
        if pos_embed is not None and self.no_embed_class:
            # the embedding covers the patches: add it, then prepend the extra tokens
            x = x + pos_embed
            pos_embed = None
        if extras:
            x = torch.cat(extras + [x], dim=1)
        if pos_embed is not None:
            x = x + pos_embed
        return self.pre_norm(self.drop_after_pos(x)), hw_shape


    def position_embedding(self, hw_shape, x):
        """The absolute position embedding for the grid ``hw_shape``, ``(1, slots + H*W, C)``
        with ``slots = pos_embed_extra_tokens`` leading extra-token slots; ``None`` for a
        model without one (``pos_embed_type='none'``)."""
        if self.pos_embed_type == 'none':
            return None
        if self.pos_embed is None:
            return _cached_sincos_pos_embed(tuple(hw_shape), self.embed_dims, x.device, x.dtype)
        return self._resample_pos_embed(self.pos_embed, self.patch_resolution, hw_shape)

    def _resample_pos_embed(self, pos_embed, src_shape, dst_shape):
        """timm's resampling of the patch part (leading extra-token slots kept as they are)."""
        # Traced, the resampling always runs (to the same grid it is the identity), so that
        # an exported graph is not tied to the example's grid.
        if not is_tracing() and tuple(src_shape) == tuple(dst_shape):
            return pos_embed
        # Imported here: importing timm's layers costs seconds, and most models never resize.
        from timm.layers import resample_abs_pos_embed
        return resample_abs_pos_embed(pos_embed, new_size=list(dst_shape),
                                      old_size=list(src_shape),
                                      num_prefix_tokens=self.pos_embed_extra_tokens,
                                      interpolation=self.interpolate_mode,
                                      antialias=self.pos_embed_antialias)

    def _resize_pos_embed_on_load(self, state_dict, prefix, *args, **kwargs):
        name = prefix + 'pos_embed'
        if name not in state_dict:
            return
        ckpt_pos_embed = state_dict[name]
        if ckpt_pos_embed.shape == self.pos_embed.shape:
            return
        ckpt_patches = ckpt_pos_embed.shape[1] - self.pos_embed_extra_tokens
        side = int(math.isqrt(max(ckpt_patches, 0)))
        if (side * side != ckpt_patches or ckpt_patches == 0
                or ckpt_pos_embed.shape[2] != self.embed_dims):
            # Leave it to load_state_dict to report the mismatch by name.
            return
        from mmengine.logging import MMLogger
        MMLogger.get_current_instance().info(
            f'Resize the pos_embed shape from {tuple(ckpt_pos_embed.shape)} to '
            f'{tuple(self.pos_embed.shape)}.')
        state_dict[name] = self._resample_pos_embed(ckpt_pos_embed, (side, side),
                                                    self.patch_resolution)
