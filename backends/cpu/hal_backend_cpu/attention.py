"""softmax and scaled_dot_product_attention on torch's CPU kernels (native softmax, the fused
flash-attention CPU kernel behind F.scaled_dot_product_attention)."""

from __future__ import annotations

from hal.eager import attention as eager

from ._common import FLOATS, kernel

kernel("softmax", name="torch", priority=20, dtypes=FLOATS)(eager.softmax)
kernel("softmax_backward", name="torch", priority=20, dtypes=FLOATS)(eager.softmax_backward)
kernel("scaled_dot_product_attention", name="torch", priority=20, dtypes=FLOATS)(eager.scaled_dot_product_attention)
kernel("scaled_dot_product_attention_backward", name="torch", priority=20, dtypes=FLOATS)(eager.scaled_dot_product_attention_backward)
