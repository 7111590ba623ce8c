"""The shapes every attention kernel is tested on (STYLE 7 and the issue's list)."""

HEAD_DIMS = [64, 80, 13]
BLOCK_SIZES = [16, 32]
HEADS = [(4, 4), (9, 3), (8, 1)]  # (num_heads, num_kv_heads): GQA ratios 1, 3, 8
