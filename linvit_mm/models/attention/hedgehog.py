"""Hedgehog attention (Zhang, Bhatia, Kumbong & Re, ICLR 2024, "The Hedgehog & the Porcupine:
Expressive Linear Attentions with Softmax Mimicry"): linear attention with a learned feature
map.

Each head has a learned ``d x d`` matrix ``W`` and ``2d`` features

    phi(x) = [exp(x W), exp(-x W)]                  feature_map='exp' (Hedgehog)
    phi(x) = [softmax(x W), softmax(-x W)]          feature_map='softmax' (LoLCATs)

(LoLCATs: Zhang et al. 2024, arXiv 2410.10254; each softmax runs over the ``d`` features of
its half). By default (``tie_qk=True``) one ``W`` serves the queries and the keys of a head;
``tie_qk=False`` gives the keys their own ``W_k`` (``feature_proj_k``), as LoLCATs' released
configs do (``tie_qk_kernels: false``). The output is the normalised linear form

    out_i = phi_q(q_i)^T S / phi_q(q_i)^T z,   S = sum_j phi_k(k_j) v_j^T,   z = sum_j phi_k(k_j),

in O(N d^2); the map ``A_ij = phi(q_i)^T phi(k_j) / sum_l phi(q_i)^T phi(k_l)`` gives
``out = A V`` and is what Hedgehog's attention-weight distillation trains ``W`` on: its maps
follow the Softmax teacher's (``AttentionDistillHook(target='map')``, an MSE where Hedgehog
uses a cross-entropy). :func:`naive_hedgehog_attention` writes both out as plainly as they
read here, the O(N^2) oracle of the tests.
"""
import torch
from torch import nn

from ...ops.linear_attention import MAX_HEAD_DIMS, fused_applies, normalised_linear_attention
from .base import WHOLE, autocast_disabled, float32_state, register_attention, state_inputs
from .map_attention import LinearMapAttention

FEATURE_MAPS = ('softmax', 'exp')
FEATURE_INITS = ('identity', 'kaiming_uniform')


def naive_hedgehog_features(t, weight, feature_map):
    """``phi(t)`` of one head's ``(B, N, d)`` rows from its definition: ``[exp(t W),
    exp(-t W)]`` or ``[softmax(t W), softmax(-t W)]``, each softmax over the ``d`` entries
    of its half. A softmax half is shifted by its own maximum, which leaves its value as
    it is; the ``'exp'`` features are the plain exponentials."""
    projected = torch.einsum('bnc,ce->bne', t, weight)      # (t W)_e = sum_c t_c W_ce
    halves = (projected, -projected)
    if feature_map == 'exp':
        return torch.cat([half.exp() for half in halves], dim=-1)
    if feature_map != 'softmax':
        raise ValueError(f'unknown feature_map {feature_map!r}')
    features = []
    for half in halves:
        powers = (half - half.amax(dim=-1, keepdim=True).detach()).exp()
        features.append(powers / powers.sum(dim=-1, keepdim=True))
    return torch.cat(features, dim=-1)


def naive_hedgehog_attention(qkv, feature_proj, feature_map, key_feature_proj=None):
    """Hedgehog attention written out from its definition (the O(N^2) oracle of the tests),
    head by head:

        A_ij = phi_q(q_i)^T phi_k(k_j) / sum_l phi_q(q_i)^T phi_k(k_l),   out_i = sum_j A_ij v_j,

    with :func:`naive_hedgehog_features` and the whole N x N map formed. It shares no code
    with :class:`HedgehogAttention`'s fast form or its map: head ``h`` of ``q``, ``k``,
    ``v`` is read off channels ``[p*C + h*d, p*C + (h+1)*d)`` of ``qkv`` (``p`` = 0, 1, 2),
    and no score is shifted, so it is exact only where the plain features are finite
    (float64 at moderate scales: it is a test oracle, the fast form is the one for any
    input). Runs in float32 at least, with autocast disabled.

    Args:
        qkv (Tensor): ``(B, N, 3C)`` output of the ``qkv`` projection.
        feature_proj (Tensor): ``(heads, d, d)``, the ``W`` of every head (of its queries
            and, without ``key_feature_proj``, of its keys).
        feature_map (str): ``'softmax'`` or ``'exp'``.
        key_feature_proj (Tensor, optional): ``(heads, d, d)``, the keys' own ``W_k``
            (untied maps); None: the keys use ``feature_proj``.

    Returns:
        tuple[Tensor, Tensor]: the output heads merged, ``(B, N, C)`` (before ``proj``), and
        the map ``(B, heads, N, N)``.
    """
    num_heads, d, _ = feature_proj.shape
    C = num_heads * d
    dtype = torch.promote_types(qkv.dtype, torch.float32)
    outs, maps = [], []
    with autocast_disabled(qkv):
        for h in range(num_heads):
            q, k, v = (qkv[..., p * C + h * d:p * C + (h + 1) * d].to(dtype) for p in range(3))
            key_weight = feature_proj if key_feature_proj is None else key_feature_proj
            phi_q = naive_hedgehog_features(q, feature_proj[h].to(dtype), feature_map)
            phi_k = naive_hedgehog_features(k, key_weight[h].to(dtype), feature_map)
            scores = torch.einsum('bim,bjm->bij', phi_q, phi_k)
            attn = scores / scores.sum(dim=-1, keepdim=True)
            outs.append(torch.einsum('bij,bjc->bic', attn, v))
            maps.append(attn)
    return torch.cat(outs, dim=-1), torch.stack(maps, dim=1)


@register_attention('hedgehog')
class HedgehogAttention(LinearMapAttention):
    """Hedgehog linear attention with a per-head learned feature map ``phi``.

    ``qkv`` and ``proj`` have a Softmax block's shapes, so a Softmax checkpoint copies into
    them as is; ``feature_proj`` (``heads x d x d``, the ``W`` of every head; of its queries
    when the maps are untied) and ``feature_proj_k`` (the keys' ``W_k``, untied maps only)
    are operator-specific and keep their own initialisation through a transfer. Queries and
    keys are not scaled by ``d^-1/2``: a scaled identity ``W`` is a temperature, which
    training learns, and neither feature map is homogeneous, so a fixed scale would be an
    arbitrary choice of starting point. Leave both out of weight decay
    (``paramwise_cfg=dict(custom_keys={'.feature_proj': dict(decay_mult=0.)})`` matches
    both names): decay pulls ``W`` towards zero, a flat map, not towards its start.

    **Initialisation.** ``feature_init='identity'`` (default) starts every ``W`` at ``I``:
    after a Softmax transfer the map is then a fixed function of the copied queries and keys
    (see ``feature_map`` below), a meaningful start for the transferred model before any
    distillation, which is what this operator's transfer relies on. Neither paper starts
    there in its released code: LoLCATs' configs (``zero_init: false``) draw ``W`` with
    ``torch.nn.init.kaiming_uniform_`` on the whole ``heads x d x d`` tensor (``fan_in =
    d * d``, so uniform on ``+-sqrt(6) / d``), which is ``feature_init='kaiming_uniform'``;
    their ``zero_init: true`` is the identity. Untied, the keys' map starts as a copy of the
    queries' (LoLCATs deep-copies the query map), and the two are trained apart.

    **How it is computed.** Write ``L(x)`` for the log-features (``[xW, -xW]``, or the
    log-softmax of each half; of keys with ``W_k`` when the maps are untied, which changes
    nothing below), so ``phi = exp(L)`` and, with
    ``K_m = log sum_j exp(L(k_j)_m)`` (per image, head and feature),

        A_ij = sum_m softmax_m(L(q_i) + K)_m * softmax_j(L(k_j)_m):

    the map is the product of a softmax over the ``2d`` features of each query and a
    softmax over the tokens of each key feature (both normalisers of the plain formula
    are inside them). The fast form is ``out = softmax_m(L(Q) + K) (softmax_j(L(K))^T V)``;
    its ``2d x d`` state is a convex combination of values per feature and every output
    row a convex combination of those, so there is no normaliser to divide by, no ``eps``
    and no ``0 / 0``, and no exponential overflows, whatever the scale of the inputs. The
    keys' softmax is taken as ``exp(L - c)`` with ``c`` the per-feature maximum over the
    tokens, its column sums ``z`` (``>= 1``) come from the same product as the state (a
    ones column on the values) and give ``K = c + log z``. ``c`` is computed without
    gradient: ``K`` and the output do not depend on it, so the gradient that treats it as
    a constant is exact. ``attention_map`` forms the map the other way round, from
    ``phi'(q_i)_m = exp(L(q_i)_m + c_m - r_i)`` (``r_i`` the row maximum) and
    ``phi'(k_j)_m = exp(L(k_j)_m - c_m)``, scores ``phi'(q_i)^T phi'(k_j)`` (``exp(-r_i)``
    times the plain ones) divided by their row sums (each at least 1).
    ``forward_reference`` is neither: it is :func:`naive_hedgehog_attention`, the plain
    formula with unshifted exponentials, written with no helper of the two forms above.

    Under autocast the fast form runs with autocast disabled, in bf16 as the projections give it
    (products and sums accumulate in float32; only the stored state rounds to bf16) or in
    float32 for fp16 (a sum over N tokens overflows fp16); the result returns to the dtype of
    the projections' output before ``proj``.

    Args:
        feature_map (str): ``'softmax'`` (default) or ``'exp'``. Both are finite in float32
            for any input (see above); they differ in what a score responds to.
            ``'softmax'`` normalises each half per token, so every token carries the same
            feature mass, scores ``phi(q)^T phi(k)`` lie in ``(0, 2]`` and the map is
            invariant to an offset of ``x W``; at ``W = I`` a score is the overlap of two
            distributions over coordinates, largest where ``q`` and ``k`` peak together, like
            the ``q^T k`` of the Softmax layer whose weights a transfer copies. ``'exp'``
            scores ``sum_m 2 cosh(a_m + b_m)`` (``a = qW``, ``b = kW``) grow exponentially
            with the entries, so at ``W = I`` on a Softmax checkpoint's unscaled queries and
            keys a few keys with large entries take much of every row of a head, whatever
            the query (random heads of 197 tokens with entries of standard deviation 3: a
            third of the queries give their largest weight to the same key; one in twenty
            with ``'softmax'``, one in thirty with Softmax attention itself). LoLCATs
            transfers Softmax models with the softmax form (its ``softmax_dim``, which also
            clamps every feature at ``1e-12``, a difference only for features below that).
            ``'exp'`` is Hedgehog's formula, the plain exponentials, kept for comparison;
            it is not LoLCATs' ``exp_dim``, which divides each half of each token by its own
            extreme, ``[exp(xW - max(xW)), exp(-xW + min(xW))]``: it scales a key's
            features by factors of that key and a query's two halves by two different
            factors, and neither cancels in the normalised map (only a factor common to
            all features of one query does), so that form computes another attention.
        tie_qk (bool): one ``W`` per head for queries and keys (True, default), or separate
            maps ``W`` (queries, ``feature_proj``) and ``W_k`` (keys, ``feature_proj_k``),
            LoLCATs' ``tie_qk_kernels: false``.
        feature_init (str): ``'identity'`` (default) or ``'kaiming_uniform'`` (LoLCATs'
            ``zero_init: false``); see above.
        fused (bool): on CUDA, run the core on the fused Triton kernels of
            :mod:`linvit_mm.ops.linear_attention` (heads of width up to 64: features of
            width 2d); False, or ``LINVIT_MM_FUSED=0``, keeps the PyTorch form.
        rope: must be None (``rope_absent_because``).
        layer_scale_init_value (float): LayerScale after ``proj``, as in ``BaseAttention``.
    """

    has_map = True
    uses_cls_token = True
    # Each head still scores token pairs from its own qkv rows, q_i = W_q x_i, k_j = W_k x_j;
    # the feature map acts on top of them (with W folded in, on W^T W_q x and W^T W_k x),
    # as elu / relu do. Hedgehog trains W so that phi(q)^T phi(k) mimics the Softmax
    # scores exp(q^T k / sqrt(d)) of the same q, k, so the structure Mimetic / Impulse put
    # into W_q^T W_k is what the learned feature map reproduces.
    has_qk_form = True
    qk_form_absent_because = None
    # qkv and proj are a Softmax block's layers; feature_proj(_k) keep their own init.
    softmax_fill = {'qkv': WHOLE, 'proj': WHOLE}
    # The fast form scales each key feature by exp(-K_m) and its queries by exp(K_m); that
    # commutes with a rotation of feature pairs only if both features of a pair share the
    # scale, which needs its own derivation (and oracle) first. BaseAttention refuses rope.
    supports_rope = False
    rope_absent_because = ('its per-feature key scaling does not commute with rotated '
                           'feature pairs')

    options = LinearMapAttention.options + ('feature_map', 'tie_qk', 'feature_init', 'fused')
    # how the feature maps start, not what they compute once trained; the fused kernels
    # compute the same function
    options_outside_the_function = LinearMapAttention.options_outside_the_function + (
        'feature_init', 'fused')

    def __init__(self, embed_dims, num_heads, qkv_bias=True, attn_drop=0., proj_drop=0.,
                 rope=None, layer_scale_init_value=0., feature_map='softmax', tie_qk=True,
                 feature_init='identity', fused=True):
        super().__init__(embed_dims, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                         proj_drop=proj_drop, rope=rope,
                         layer_scale_init_value=layer_scale_init_value)
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f'unknown feature_map {feature_map!r}; valid feature maps are: '
                             f'{", ".join(FEATURE_MAPS)}')
        if feature_init not in FEATURE_INITS:
            raise ValueError(f'unknown feature_init {feature_init!r}; valid initialisations '
                             f'are: {", ".join(FEATURE_INITS)}')
        self.feature_map = feature_map
        self.fused = fused
        self.tie_qk = bool(tie_qk)
        self.feature_init = feature_init
        shape = (num_heads, self.head_dims, self.head_dims)
        self.feature_proj = nn.Parameter(torch.empty(shape))
        self.feature_proj_k = None if self.tie_qk else nn.Parameter(torch.empty(shape))
        self.reset_feature_proj()

    def reset_feature_proj(self):
        """Every head's ``W`` (and ``W_k``, a copy of ``W``) as ``feature_init`` says:
        the identity, or ``kaiming_uniform_`` on the whole ``heads x d x d`` tensor."""
        with torch.no_grad():
            if self.feature_init == 'identity':
                self.feature_proj.copy_(torch.eye(self.head_dims).expand_as(self.feature_proj))
            else:
                nn.init.kaiming_uniform_(self.feature_proj)
            if self.feature_proj_k is not None:
                self.feature_proj_k.copy_(self.feature_proj)

    def key_feature_proj(self):
        """The keys' ``W``: ``feature_proj_k`` if the maps are untied, else ``feature_proj``."""
        return self.feature_proj if self.feature_proj_k is None else self.feature_proj_k

    def signed_proj(self, dtype, keys=False):
        """``[W, -W]``, ``(heads, d, 2d)``: one product gives both halves of ``L(x)``; the
        keys' ``W`` with ``keys``."""
        weight, = float32_state(self.key_feature_proj() if keys else self.feature_proj)
        weight = weight.to(dtype)
        return torch.cat([weight, -weight], dim=-1)

    def log_features(self, x, signed_proj, in_place=False):
        """``L(x)``, ``(B, heads, N, 2d)``, of ``(B, heads, N, d)`` heads, in their dtype;
        ``in_place`` (no autograd) takes the log-softmax in the product's buffer."""
        signed = x @ signed_proj
        if self.feature_map == 'softmax':
            halves = signed.unflatten(-1, (2, self.head_dims))
            if in_place:
                torch.log_softmax(halves, dim=-1, out=halves)
            else:
                signed = halves.log_softmax(dim=-1).flatten(-2)
        return signed

    def _writable(self, in_place):
        """Whether ``log_features``' result may be overwritten: autograd keeps log_softmax's
        output for its backward, but not the product's."""
        return in_place or self.feature_map == 'exp'

    @staticmethod
    def _key_max(log_k):
        """Each feature's maximum over the tokens, without gradient (0 where there is no
        token: ``amax`` refuses an empty dimension)."""
        with torch.no_grad():
            if log_k.shape[-2] == 0:
                return log_k.new_zeros(*log_k.shape[:-2], 1, log_k.shape[-1])
            return log_k.amax(dim=-2, keepdim=True)

    def _key_features(self, log_k, in_place=False):
        """``exp(L(k) - c)`` and ``c`` (per-feature maximum over the tokens, no gradient)."""
        key_max = self._key_max(log_k)
        shifted = log_k.sub_(key_max) if self._writable(in_place) else log_k - key_max
        return shifted.exp_(), key_max

    def _fused_linear(self, q, k, v):
        """The core on the fused kernels (:mod:`linvit_mm.ops.linear_attention`), from
        features shifted into (0, 1]: keys by each feature's maximum over the tokens, queries
        by the same shift plus their own row maximum. The product of a query's and a key's
        features, hence the output, does not change; the shifts carry no gradient."""
        log_k = self.log_features(k, self.signed_proj(q.dtype, keys=True))
        key_max = self._key_max(log_k)
        log_q = self.log_features(q, self.signed_proj(q.dtype)) + key_max
        with torch.no_grad():
            row_max = log_q.amax(dim=-1, keepdim=True)
        # every feature's largest key weighs 1: the key sums are >= 1, no eps needed
        return normalised_linear_attention((log_q - row_max).exp(), (log_k - key_max).exp(),
                                           v, 0., 'identity', fused=True)

    def _linear(self, q, k, v, rotation=None):
        if self.fused and 2 * self.head_dims <= MAX_HEAD_DIMS and fused_applies(q, k, v):
            return self._fused_linear(q, k, v)
        out_dtype = v.dtype
        # Without autograd, each N x 2d intermediate reuses the buffer of the one before: at
        # 16k tokens they are 50 MB each, and fresh ones cost page faults and bandwidth.
        in_place = not torch.is_grad_enabled()
        with autocast_disabled(v):
            q, k, v = state_inputs(q, k, v)
            phi_k, key_max = self._key_features(
                self.log_features(k, self.signed_proj(q.dtype, keys=True), in_place), in_place)
            # A ones column on the values carries the key sums z through the same product.
            # The state is formed transposed, V^T phi(K), so that the gradient reaching
            # phi(K) is contiguous: the transposed one made every pointwise backward slow.
            ones = torch.ones_like(v[..., :1])
            state = torch.cat([v, ones], dim=-1).transpose(-2, -1) @ phi_k   # (B, h, d+1, 2d)
            key_sum = state[..., -1:, :]                                      # z >= 1
            kv_state = (state[..., :-1, :] / key_sum).transpose(-2, -1)   # softmax_j(L(K))^T V
            log_key_mass = key_max + key_sum.log()                            # K, (B, h, 1, 2d)
            logits = self.log_features(q, self.signed_proj(q.dtype), in_place)
            if self._writable(in_place):
                logits = logits.add_(log_key_mass)
            else:
                logits = logits + log_key_mass
            if in_place:
                query_weights = torch.softmax(logits, dim=-1, out=logits)
            else:
                query_weights = logits.softmax(dim=-1)
            out = query_weights @ kv_state
        return out.to(out_dtype)

    def _map(self, q, k, rotation=None):
        """Row-normalised ``phi'(q) phi'(k)^T`` in float32 (class docstring)."""
        with autocast_disabled(q):
            q, k = float32_state(q, k)
            phi_k, key_max = self._key_features(
                self.log_features(k, self.signed_proj(q.dtype, keys=True)))
            log_q = self.log_features(q, self.signed_proj(q.dtype)) + key_max
            with torch.no_grad():
                row_max = log_q.amax(dim=-1, keepdim=True)
            scores = (log_q - row_max).exp() @ phi_k.transpose(-2, -1)
            return scores / scores.sum(dim=-1, keepdim=True)

    def naive_forward(self, x, hw_shape):
        """:func:`naive_hedgehog_attention` of ``x``: the output heads merged (before
        ``proj``, in the projections' dtype) and the map (float32 at least)."""
        self.num_extra_tokens(x, hw_shape)  # validates the grid
        qkv = self.qkv(x)
        out, attn = naive_hedgehog_attention(qkv, self.feature_proj, self.feature_map,
                                             self.feature_proj_k)
        return out.to(qkv.dtype), attn

    def forward_reference(self, x, hw_shape):
        return self.project(self.naive_forward(x, hw_shape)[0])

    def core_macs(self, num_tokens, hw_shape):
        # x W for queries and keys (N d^2 per head each; -x W is a sign, counted once);
        # the 2d x d state and its read (2 N d^2 per head each); the key sums over the 2d
        # features (2 N d per head). No normaliser is read: the query weights sum to 1.
        C, d = self.embed_dims, self.head_dims
        return 2 * num_tokens * C * d + 4 * num_tokens * C * d + 2 * num_tokens * C

    def extra_repr(self):
        return (f'{super().extra_repr()}, feature_map={self.feature_map!r}, '
                f'tie_qk={self.tie_qk}, feature_init={self.feature_init!r}')
