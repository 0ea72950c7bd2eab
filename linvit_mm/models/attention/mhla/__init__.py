"""Multi-Head Linear Attention (MHLA; Zhang et al., ICLR 2026, "MHLA: Restoring
Expressivity of Linear Attention via Token-Level Multi-Head").

The patch grid is cut into ``M`` non-overlapping spatial blocks, the "token-level
heads". Each block ``b`` sums its own key-value state and normaliser,
``S_b = sum phi(k) v^T`` and ``z_b = sum phi(k)``; a learned ``M x M`` matrix ``W``
mixes them, and a query ``t`` in block ``i`` reads

    out_t = phi(q_t)^T (sum_j W_ij S_j) / (phi(q_t)^T sum_j W_ij z_j + eps)

(``normaliser='consistent'``, the default), so different regions see differently weighted
summaries of the image while the cost stays O(N C d + M^2 C d). A 5 x 5 depthwise
convolution of the values, in image layout, is added before the output projection.

The authors' code (``MHLA_Normed_Torch`` of DAGroup-PKU/MHLA), which produced the paper's
MHLA results, divides instead by ``sum_j W_ij phi(q_{j,p})^T z_j + eps``, where
``q_{j,p}`` is the query at the reading query's in-block position ``p`` of block ``j``
(``normaliser='official'``): each block's normaliser is paired with another block's
query, so the weights of a query's keys do not sum to one. The default keeps the form
whose numerator and normaliser come from the same query, a weighted mean of the values
for positive mixing weights (equal values in, that value out), which a Softmax
initialisation relies on; ``'official'`` reproduces the authors' module (with
``attn_norm``, ``qk_norm``, their block layout (:data:`OFFICIAL_IMAGENET`) and
``qkv_bias=False``).
"""
from .attention import NORMALISERS, OFFICIAL_IMAGENET, MultiHeadLinearAttention
from .blocks import MIXING_INITS, BlockLayout, distance_mixing_matrix

__all__ = ['BlockLayout', 'MIXING_INITS', 'MultiHeadLinearAttention', 'NORMALISERS',
           'OFFICIAL_IMAGENET', 'distance_mixing_matrix']
