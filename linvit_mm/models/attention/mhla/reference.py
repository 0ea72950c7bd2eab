"""The O(N^2) oracle of MHLA, apart from its fast form: explicit sums over every pair of
tokens, built from the module's projections and parameters and nothing else of the fast form
(no block layout, padding, block reshaping, feature helper or convolution kernel), so a fault
in one form shows up as a disagreement with the other."""
import torch
from torch import nn

from ..base import autocast_disabled


class MHLAReference:
    """``forward_reference`` and its tables for :class:`MultiHeadLinearAttention`, which
    inherits them; they read its parameters (``qkv``, ``block_mixing``, ``value_conv``, the
    norms, ``rope``) and settings."""

    def _reference_block_shape(self, hw_shape):
        """``(block_h, block_w)`` for ``hw_shape``; refuses a grid the fixed layout cannot hold."""
        H, W = hw_shape
        rows, cols = self.num_blocks
        if self.block_size is None:
            return -(-H // rows), -(-W // cols)
        if H > rows * self.block_size[0] or W > cols * self.block_size[1]:
            raise ValueError(f'a {H}x{W} grid does not fit the fixed layout of {rows}x{cols} '
                             f'blocks of {self.block_size[0]}x{self.block_size[1]} tokens')
        return self.block_size

    def _reference_positions(self, hw_shape, num_extra):
        """Per token: whether it is a patch, its row, column and block (blocks row-major)."""
        H, W = hw_shape
        block_h, block_w = self._reference_block_shape(hw_shape)
        token = torch.arange(num_extra + H * W, device=self.block_mixing.device)
        patch = token >= num_extra
        position = (token - num_extra).clamp(min=0)
        row, col = position // W, position % W
        return patch, row, col, (row // block_h) * self.num_blocks[1] + col // block_w

    def reference_mixing_weights(self, hw_shape, num_extra=0):
        """``(N, N)`` factor on ``phi(q_t)^T phi(k_s)``: ``W[block(t), block(s)]`` between
        patch tokens, 1 wherever an extra token is involved.

        A patch token at row ``r`` and column ``c`` lies in block
        ``(r // block_h) * cols + c // block_w`` (blocks row-major, the last row or column
        of blocks shorter, or empty, when a side does not fill the layout), with
        ``block_h x block_w`` the fixed ``block_size`` or ``ceil(H / rows) x ceil(W / cols)``.
        """
        patch, _, _, block = self._reference_positions(hw_shape, num_extra)
        both_patches = patch[:, None] & patch[None, :]
        mixed = self.block_mixing[block[:, None], block[None, :]]
        return torch.where(both_patches, mixed, torch.ones_like(mixed))

    def reference_partners(self, hw_shape, num_extra=0):
        """``(N, N)`` index of the query the official normaliser pairs with key ``s`` for
        query ``t``: the token of ``s``'s block at ``t``'s in-block position when both are
        patches (``-1`` where that position is off the grid), else ``t`` itself.

        Query ``t`` at ``(r, c)`` and a key in block ``(I, J)`` of ``block_h x block_w``
        tokens pair with the token at ``(I * block_h + r % block_h, J * block_w + c % block_w)``.
        """
        H, W = hw_shape
        block_h, block_w = self._reference_block_shape(hw_shape)
        patch, row, col, block = self._reference_positions(hw_shape, num_extra)
        cols = self.num_blocks[1]
        partner_row = (block[None, :] // cols) * block_h + (row % block_h)[:, None]
        partner_col = (block[None, :] % cols) * block_w + (col % block_w)[:, None]
        partner = num_extra + partner_row * W + partner_col
        on_grid = (partner_row < H) & (partner_col < W)
        partner = torch.where(on_grid, partner, torch.full_like(partner, -1))
        both_patches = patch[:, None] & patch[None, :]
        own = torch.arange(len(patch), device=patch.device)[:, None].expand_as(partner)
        return torch.where(both_patches, partner, own)

    def _reference_norms(self, x):
        """``attn_norm``'s LayerNorm by its formula, ``(x - mean) / sqrt(var + eps) * w + b``
        (biased variance over the channels); ``x`` unchanged without it."""
        if not isinstance(self.norm, nn.LayerNorm):
            return x
        mean = x.mean(dim=-1, keepdim=True)
        variance = ((x - mean)**2).mean(dim=-1, keepdim=True)
        return (x - mean) / torch.sqrt(variance + self.norm.eps) * self.norm.weight + self.norm.bias

    @staticmethod
    def _reference_rms(norm, t):
        """RMSNorm by its formula, ``t / sqrt(mean(t^2) + eps) * w`` (PyTorch's eps ``None``
        is the dtype's machine epsilon); ``t`` unchanged for an identity."""
        if not isinstance(norm, nn.RMSNorm):
            return t
        eps = torch.finfo(t.dtype).eps if norm.eps is None else norm.eps
        return t / torch.sqrt((t * t).mean(dim=-1, keepdim=True) + eps) * norm.weight

    def _reference_value_conv(self, values, hw_shape, num_extra):
        """The depthwise value convolution as a sum over the kernel's taps, zero for the
        extra tokens: patch ``(r, c)`` of channel ``ch`` gets
        ``bias[ch] + sum_ij weight[ch, i, j] * v[r + i - p, c + j - p, ch]``, with positions
        off the grid reading zero (``p`` is half the kernel side)."""
        B, _, C = values.shape
        H, W = hw_shape
        weight, bias = self.value_conv.weight[:, 0], self.value_conv.bias   # (C, K, K), (C,)
        K = weight.shape[-1]
        p = K // 2
        image = values[:, num_extra:].reshape(B, H, W, C)
        framed = image.new_zeros(B, H + 2 * p, W + 2 * p, C)
        framed[:, p:p + H, p:p + W] = image
        local = bias.expand(B, H, W, C)
        for i in range(K):
            for j in range(K):
                local = local + weight[:, i, j] * framed[:, i:i + H, j:j + W]
        return torch.cat([local.new_zeros(B, num_extra, C), local.reshape(B, H * W, C)], dim=1)

    def forward_reference(self, x, hw_shape):
        """The same operator as explicit sums over every pair of tokens, O(N^2):

            out_t = sum_s A_ts v_s / (sum_s W_ts phi(q_u)^T phi(k_s) + eps),
            A_ts = W_ts (R_t phi(q_t))^T (R_s phi(k_s)),

        with ``W`` from :meth:`reference_mixing_weights`, ``phi(x) = relu(x) +
        feature_floor``, ``R_t`` the token's RoPE matrix (identity without RoPE and for
        extra tokens) and ``u = t`` under the consistent normaliser, ``u`` the partner of
        :meth:`reference_partners` under the official one (a missing partner reads zero);
        then the value convolution and the output projection. ``attn_norm`` and ``qk_norm``
        are applied by their formulas.
        """
        B, N, C = x.shape
        H, W = hw_shape
        num_extra = N - H * W
        if num_extra < 0:
            raise ValueError(f'{N} tokens cannot hold a {H}x{W} grid')
        if H < 1 or W < 1:
            raise ValueError(f'the patch grid must be at least 1x1, got {H}x{W}')
        h, d = self.num_heads, self.head_dims
        q, k, values = self.qkv(self._reference_norms(x)).chunk(3, dim=-1)
        q, k = self._reference_rms(self.q_norm, q), self._reference_rms(self.k_norm, k)
        out_dtype = values.dtype
        # the state sums of the fast form run in float32 at least; so does this form
        compute_dtype = torch.promote_types(out_dtype, torch.float32)
        with autocast_disabled(x):
            q, k, v = (t.to(compute_dtype).reshape(B, N, h, d).transpose(1, 2)
                       for t in (q, k, values))                             # (B, h, N, d)
            phi_q, phi_k = (torch.where(t > 0, t, 0.) + self.feature_floor for t in (q, k))
            weights = self.reference_mixing_weights(hw_shape, num_extra).to(compute_dtype)
            if self.normaliser == 'official':
                # index -1 (no partner) reads an appended zero query
                padded_q = torch.cat([phi_q, phi_q.new_zeros(B, h, 1, d)], dim=2)
                paired = padded_q[:, :, self.reference_partners(hw_shape, num_extra)]
                normaliser = torch.einsum('ts,bhtsc,bhsc->bht', weights, paired, phi_k)
            else:
                normaliser = torch.einsum('ts,bhtc,bhsc->bht', weights, phi_q, phi_k)
            if self.rope is None:
                rot_q, rot_k = phi_q, phi_k
            else:
                rotation = self.rope(hw_shape, num_extra, phi_q).as_reference()
                rot_q, rot_k = rotation.rotate(phi_q), rotation.rotate(phi_k)
            scores = weights * torch.einsum('bhtc,bhsc->bhts', rot_q, rot_k)
            numerator = torch.einsum('bhts,bhsc->bhtc', scores, v)
            out = numerator / (normaliser.unsqueeze(-1) + self.eps)
        out = out.to(out_dtype).transpose(1, 2).reshape(B, N, C)
        out = out + self._reference_value_conv(values, hw_shape, num_extra)
        return self.project(out)
