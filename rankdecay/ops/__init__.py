"""The engine: one diagonal-plus-rank-R recurrence, every mechanism an instance of it.

    S_t = (Diag(exp g_t) - sum_r a_{t,r} b_{t,r}^T) S_{t-1} + sum_j k_{t,j} v_{t,j}^T
    o_t = scale * S_t^T q_t

``dplr`` computes it by the per-token loop (``mode="naive"``) or the chunkwise
WY/UT algorithm (``mode="chunk"``); the mechanism functions build its arguments.
This package imports nothing else of rankdecay.
"""
from .backends import backends, chunk_flops_per_token
from .dplr import dplr
from .mechanisms import (
    delta_rule,
    gated_delta_product,
    gated_delta_rule,
    gated_delta_rule_decode,
    kda_decode,
    hdla_decode,
    hh_delta_rule_decode,
    gated_delta_product_decode,
    gla,
    hdla,
    head_in_head_mask,
    hh_delta_rule,
    kda,
    linear_attn,
    retention,
    simple_gla,
)

__all__ = [
    "backends",
    "chunk_flops_per_token",
    "dplr",
    "linear_attn",
    "retention",
    "simple_gla",
    "gla",
    "delta_rule",
    "gated_delta_rule",
    "gated_delta_rule_decode",
    "kda_decode",
    "hdla_decode",
    "hh_delta_rule_decode",
    "gated_delta_product_decode",
    "gated_delta_product",
    "kda",
    "hdla",
    "hh_delta_rule",
    "head_in_head_mask",
]
