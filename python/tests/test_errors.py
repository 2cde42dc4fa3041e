"""absl::Status errors arrive as Python exceptions with the Status message."""

import numpy as np
import pytest

import fp4kv
from conftest import halves, make_cache


def test_exception_classes():
    assert issubclass(fp4kv.InvalidArgumentError, ValueError)
    assert issubclass(fp4kv.InvalidArgumentError, fp4kv.Error)
    assert issubclass(fp4kv.NotFoundError, LookupError)
    assert issubclass(fp4kv.FailedPreconditionError, RuntimeError)
    assert issubclass(fp4kv.ResourceExhaustedError, MemoryError)
    assert issubclass(fp4kv.UnimplementedError, NotImplementedError)


def test_invalid_options_name_the_option():
    o = fp4kv.KVCacheOptions()
    with pytest.raises(fp4kv.InvalidArgumentError, match=r"^num_layers: expected >= 1, got 0$"):
        fp4kv.KVCache(o)
    with pytest.raises(ValueError, match="head_dim"):
        fp4kv.Appender(fp4kv.CacheGeometry(2, 60, 60, 16, 4))


def test_unknown_sequence_is_not_found():
    c = make_cache()
    with pytest.raises(fp4kv.NotFoundError, match="77"):
        c.release_sequence(77)
    s = c.create_sequence()
    c.release_sequence(s)
    with pytest.raises(LookupError):
        c.sequence_length(s)


def test_pool_exhausted(rng):
    c = make_cache(num_pages=4, max_tokens_per_step=1024)
    s, t = c.create_sequence(), c.create_sequence()
    with pytest.raises(fp4kv.ResourceExhaustedError):
        c.prepare_step([(s, 40), (t, 40)])  # 6 pages of 4
    assert c.sequence_length(s) == 0  # nothing changed
    assert c.stats().pages_free == 4


def test_bad_tensors_are_named(rng):
    c = make_cache(num_layers=1)
    s = c.create_sequence()
    c.prepare_step([(s, 4)])
    app = c.appender(fp4kv.DType.f16)
    k = halves(rng, 4, 2, 64)
    with pytest.raises(fp4kv.InvalidArgumentError, match="key: expected dtype f16, got f32"):
        app.run(0, k.astype(np.float32), k)
    with pytest.raises(fp4kv.InvalidArgumentError, match="value"):
        app.run(0, k, halves(rng, 4, 3, 64))  # wrong heads
    with pytest.raises(fp4kv.InvalidArgumentError, match="layer"):
        app.run(5, k, k)
    with pytest.raises(fp4kv.InvalidArgumentError, match="key: expected a tensor"):
        app.run(0, [1, 2, 3], k)
    with pytest.raises(fp4kv.InvalidArgumentError, match="^key: DLTensor: "):
        app.run(0, k.astype(np.complex64), k)


def test_read_only_outputs_are_refused(rng):
    x = halves(rng, 4, 64)
    packed, scales = np.zeros((4, 32), np.uint8), np.zeros((4, 4), np.uint8)
    packed.flags.writeable = False
    with pytest.raises(fp4kv.InvalidArgumentError, match="^packed: expected a writable tensor"):
        fp4kv.quantize_linear(x, packed, scales, 1.0)
    # Read-only inputs are fine.
    x.flags.writeable = False
    fp4kv.quantize_linear(x, np.zeros((4, 32), np.uint8), scales, 1.0)


def test_bad_global_scale():
    x = np.ones((4, 64), np.float16)
    p, s = np.zeros((4, 32), np.uint8), np.zeros((4, 4), np.uint8)
    with pytest.raises(fp4kv.InvalidArgumentError, match="global_scale"):
        fp4kv.quantize_linear(x, p, s, -1.0, recipe=fp4kv.Recipe.standard())
    with pytest.raises(fp4kv.InvalidArgumentError, match="global_scale: expected a float or an fp32 tensor"):
        fp4kv.quantize_linear(x, p, s, np.ones(1, np.int32))


def test_read_only_cache_views_cannot_be_appended_to(rng):
    c = make_cache(num_layers=1)
    pc = c.layer_cache(0)
    assert pc.read_only
    k = halves(rng, 1, 2, 64)
    with pytest.raises(fp4kv.InvalidArgumentError, match="^cache: expected writable pools"):
        fp4kv.quantize_append_by_slot(k, k, np.zeros(1, np.int64), pc, 1.0, 1.0)
    assert not np.from_dlpack(pc.k_data).any()


def test_moved_and_failed_precondition():
    c = make_cache(num_layers=1)
    with pytest.raises(fp4kv.FailedPreconditionError, match="count"):
        c.read_scale_events(0)
