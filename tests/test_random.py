"""spmd.random: the hash (int64 torch ops equal the unsigned reference; uniform, bit
balance, no correlation between neighbouring indices or draws), and the one-device
context: each random call a pure function of (seed, draw, index)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import spmd
from spmd.core.errors import SpecError
from spmd.random.hashing import bits, draw_key, global_index, local_index, mix64, uniform

N = 1 << 16


def _ref_bits(key: int, i: int) -> int:
    """The hash in Python ints (unsigned 64-bit arithmetic)."""
    m = (1 << 64) - 1
    k = mix64(key ^ mix64(1))
    k1, k2 = mix64(k + 1), mix64(k + 2)
    return mix64(mix64((i * 0x9E3779B97F4A7C15 + k1) & m) ^ k2)


def test_int64_ops_wrap_like_the_unsigned_reference():
    key = draw_key(12345, 7)
    idx = torch.tensor([0, 1, 2, 2 ** 40 + 3, 2 ** 62 - 1], dtype=torch.int64)
    got = [v & ((1 << 64) - 1) for v in bits(key, idx).tolist()]
    assert got == [_ref_bits(key, i) for i in idx.tolist()]


def test_uniform_is_uniform_and_bits_are_balanced():
    u = uniform(draw_key(0, 0), torch.arange(N))
    counts = torch.histc(u, bins=64, min=0, max=1)
    chi2 = float(((counts - N / 64) ** 2 / (N / 64)).sum())
    assert chi2 < 120  # 63 degrees of freedom: p < 1e-5 above 120
    b = bits(draw_key(1, 0), torch.arange(N))
    ones = torch.stack([((b >> k) & 1).double().mean() for k in range(64)])
    assert float((ones - 0.5).abs().max()) < 0.02  # 5 sigma of a fair bit over 2**16


def test_neighbouring_indices_and_draws_are_uncorrelated():
    idx = torch.arange(N)
    u0 = uniform(draw_key(3, 0), idx)
    u1 = uniform(draw_key(3, 1), idx)
    v0 = uniform(draw_key(4, 0), idx)

    def corr(a, b):
        return float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    tol = 5 / math.sqrt(N)
    assert abs(corr(u0[:-1], u0[1:])) < tol      # index i and i + 1
    assert abs(corr(u0, u1)) < tol               # draw k and k + 1
    assert abs(corr(u0, v0)) < tol               # seeds 3 and 4
    assert not torch.equal(u0, u1)


@pytest.mark.parametrize("dtype,n", [(torch.float64, 53), (torch.float32, 24),
                                     (torch.float16, 11), (torch.bfloat16, 8)])
def test_uniform_takes_the_top_bits_of_each_dtype(dtype, n):
    u = uniform(draw_key(0, 0), torch.arange(4096), dtype)
    assert u.dtype == dtype and float(u.max()) < 1 and float(u.min()) >= 0
    scaled = u.double() * 2 ** n
    assert torch.equal(scaled, scaled.floor())


def test_global_index_of_a_block_is_its_part_of_the_whole():
    whole = local_index((3, 7, 5), "cpu")
    block = global_index((2, 3, 5), (3, 7, 5), (1, 4, 0), "cpu")
    assert torch.equal(block, whole[1:3, 4:7, :])
    assert global_index((3, 0, 5), (3, 7, 5), (0, 7, 0), "cpu").shape == (3, 0, 5)


def _draws(x):
    return [torch.rand(3, 4, dtype=torch.float64), torch.randn(2, 5), torch.randint(3, 9, (7,)),
            torch.rand_like(x), torch.randn_like(x), torch.randint_like(x, 10),
            torch.randperm(6), torch.normal(x, 2.0), torch.normal(0.0, 1.0, (3,)),
            torch.bernoulli(torch.full((4, 4), 0.3)), x.clone().uniform_(2, 3),
            x.clone().normal_(), x.clone().bernoulli_(0.5), x.clone().exponential_(),
            F.dropout(x, 0.5), F.dropout2d(x, 0.5), F.alpha_dropout(x, 0.2, True),
            F.dropout1d(x[0], 0.5), F.dropout3d(x.unsqueeze(0), 0.5)]


def test_every_draw_is_a_function_of_seed_and_draw_number():
    x = torch.randn(2, 3, 4, 5)
    with spmd.random.invariant(7) as s:
        a = _draws(x)
    state = torch.get_rng_state()
    with spmd.random.invariant(7):
        b = _draws(x)
    assert torch.equal(state, torch.get_rng_state())  # torch's own generator untouched
    assert s.draws == len(a)
    for u, v in zip(a, b):
        assert u.shape == v.shape and u.dtype == v.dtype and torch.equal(u, v)
    with spmd.random.invariant(8):
        c = _draws(x)
    assert not torch.equal(a[0], c[0])


def test_values_have_the_right_ranges_and_shapes():
    x = torch.ones(4, 8, 6, 6)
    with spmd.random.invariant(0):
        r = torch.randint(3, 9, (1000,))
        p = torch.randperm(50)
        d2 = F.dropout2d(x, 0.5)
        d = F.dropout(x, 0.25)
        z = torch.randn(20000, dtype=torch.float64)
        e = F.dropout(x, 0.5, training=False)
    assert int(r.min()) >= 3 and int(r.max()) <= 8 and r.dtype == torch.int64
    assert sorted(p.tolist()) == list(range(50))
    per_channel = d2.flatten(2)
    assert torch.equal(per_channel.amax(2), per_channel.amin(2))  # whole channels dropped
    assert set(d.unique().tolist()) <= {0.0, float(torch.tensor(1 / 0.75))}
    assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05
    assert e is x


def test_resume_from_a_number_of_draws():
    with spmd.random.invariant(5):
        first, second = torch.rand(3), torch.rand(3)
    with spmd.random.invariant(5, draws=1):
        again = torch.rand(3)
    assert torch.equal(second, again) and not torch.equal(first, second)


def test_dropout_gradient_is_the_mask():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    with spmd.random.invariant(1):
        y = F.dropout(x, 0.5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y != 0).double() * 2, rtol=0, atol=0)


def test_meta_tensors_draw_nothing():
    with spmd.random.invariant(0) as s:
        torch.rand(3, device="meta")
        F.dropout(torch.empty(2, 3, device="meta"), 0.5)
    assert s.draws == 0


def test_calls_without_an_invariant_version_are_refused():
    with spmd.random.invariant(0), pytest.raises(SpecError, match="multinomial has no "
                                                  "mesh-invariant version"):
        torch.multinomial(torch.ones(4), 2)
    g = torch.Generator()
    with spmd.random.invariant(0), pytest.raises(SpecError, match="rand is given its own "
                                                  "generator="):
        torch.rand(3, generator=g)


def test_calls_that_draw_nothing_pass():
    x = torch.randn(2, 3, 4, 5)
    with spmd.random.invariant(0) as s:
        torch.testing.assert_close(F.rrelu(x), F.leaky_relu(x, (1 / 8 + 1 / 3) / 2))
        F.scaled_dot_product_attention(x, x, x)
        F.dropout(x, 0.0)
        torch.randn(3, device="meta")
    assert s.draws == 0


def test_bad_seeds_are_refused():
    with pytest.raises(TypeError, match="seed must be an int >= 0"):
        spmd.random.invariant(-1)


def test_a_draw_inside_a_checkpointed_function_is_refused():
    """Checkpoint's recompute would be the stream's next draw: another mask than the
    forward's, so the gradient would not be the output's."""
    from torch.utils.checkpoint import checkpoint
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with spmd.random.invariant(0), pytest.raises(
            SpecError, match=r"dropout is drawn under spmd.random.invariant inside "
                             r"torch.utils.checkpoint's function"):
        checkpoint(lambda t: F.dropout(t, 0.5) * t, x, use_reentrant=False)
    with spmd.random.invariant(0):  # outside the checkpointed function: drawn once
        y = checkpoint(lambda t: t * t, F.dropout(x, 0.5), use_reentrant=False)
    (g,) = torch.autograd.grad(y.sum(), x)
    keep = (y != 0).double()
    torch.testing.assert_close(g, 2 * keep * x * 4, rtol=1e-12, atol=1e-12)  # (2x)^2 -> 8x


@pytest.mark.parametrize("schedule", ["greenlets", "threads"])
def test_every_rank_starts_from_the_callers_draws_whichever_finishes_first(schedule):
    """A body with no collective: rank 0 may finish (and hand its count back to the
    caller's stream) before another rank starts; that rank still starts from the
    caller's draws, so every rank draws what one device draws, and the caller's stream
    counts the draw once."""
    mesh = spmd.Mesh((3,), ("sp",), schedule=schedule)
    f = spmd.shard_map(lambda x: x + torch.rand(4, dtype=torch.float64), mesh,
                       spmd.P(), spmd.P(), check_rep=True)
    with spmd.random.invariant(5) as stream:
        got = f(torch.zeros(4, dtype=torch.float64))
        assert stream.draws == 1
    with spmd.random.invariant(5):
        want = torch.rand(4, dtype=torch.float64)
    assert torch.equal(got, want)
