import numpy as np
import pytest

import fp4kv


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def make_cache(num_layers=2, heads=2, head_dim=64, page_size=16, num_pages=32, **kw):
    o = fp4kv.KVCacheOptions()
    o.num_layers = num_layers
    o.geometry = fp4kv.CacheGeometry(
        num_kv_heads=heads, head_dim_k=head_dim, page_size=page_size, num_pages=num_pages
    )
    o.max_seqs_per_step = kw.pop("max_seqs_per_step", 8)
    o.max_tokens_per_step = kw.pop("max_tokens_per_step", 256)
    for k, v in kw.items():
        setattr(o, k, v)
    return fp4kv.KVCache(o)


def halves(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float16)
