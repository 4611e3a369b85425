"""spmd.custom_vjp: a function with a hand-written backward, seen by every autograd entry
point (``.backward()``, ``torch.autograd.grad``, ``torch.func.grad``)."""
import functools
import threading

import pytest
import torch

import spmd

F64 = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


# A rule that is deliberately NOT the derivative of the function, so a test can tell the
# custom rule from autodiff of ``fun``: d/dx is scaled by 10, d/dy is the true one.
@spmd.custom_vjp
def mul(x, y):
    return x * y


def _mul_fwd(x, y):
    return x * y, (x, y)


def _mul_bwd(res, g):
    x, y = res
    return 10 * g * y, g * x


mul.defvjp(_mul_fwd, _mul_bwd)


def _grads(method, f, *args):
    """Gradients of ``f(*args).sum()`` w.r.t. every arg, by one of the three entry points."""
    if method == "backward":
        leaves = [a.detach().clone().requires_grad_() for a in args]
        f(*leaves).sum().backward()
        return [a.grad for a in leaves]
    if method == "autograd.grad":
        leaves = [a.detach().clone().requires_grad_() for a in args]
        return list(torch.autograd.grad(f(*leaves).sum(), leaves))
    if method == "func.grad":
        return list(torch.func.grad(lambda *a: f(*a).sum(), argnums=tuple(range(len(args))))(
            *[a.detach() for a in args]))
    raise AssertionError(method)


METHODS = ["backward", "autograd.grad", "func.grad"]


@pytest.mark.parametrize("method", METHODS)
def test_the_rule_is_used(method):
    x, y = _x(3), _x(3, seed=1)
    gx, gy = _grads(method, mul, x, y)
    torch.testing.assert_close(gx, 10 * y, rtol=0, atol=0)
    torch.testing.assert_close(gy, x, rtol=0, atol=0)


def test_value_is_the_function_value():
    x, y = _x(3).requires_grad_(), _x(3, seed=1)
    out = mul(x, y)
    assert torch.equal(out.detach(), x.detach() * y)
    assert out.requires_grad and out.grad_fn is not None


@pytest.mark.parametrize("method", METHODS)
def test_used_twice(method):
    x, y = _x(4), _x(4, seed=1)
    # f = mul(mul(x, y), y) + mul(x, 2y)
    f = lambda x, y: mul(mul(x, y), y) + mul(x, 2 * y)
    gx, gy = _grads(method, f, x, y)
    # outer mul: d/d(first) = 10 * y, d/d(second) = x*y; inner mul: d/dx = 10 * g * y
    want_x = 10 * y * (10 * y) + 10 * (2 * y)
    want_y = (10 * y) * x + x * y + 2 * x
    torch.testing.assert_close(gx, want_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gy, want_y, rtol=1e-12, atol=1e-12)


@spmd.custom_vjp
def outer(x):
    """A custom_vjp whose function, fwd and bwd all call another custom_vjp."""
    return mul(x, x)


# the rule: gradient = cotangent (the true derivative would be 2x)
outer.defvjp(lambda x: (mul(x, x), x), lambda x, g: (mul(g, torch.full_like(x, 0.5)) * 2,))


@pytest.mark.parametrize("method", METHODS)
def test_nested_custom_vjp(method):
    x = _x(5)
    (gx,) = _grads(method, outer, x)
    torch.testing.assert_close(gx, torch.ones_like(x), rtol=0, atol=0)
    # composed with itself, and used twice
    (gx,) = _grads(method, lambda x: outer(outer(x)) + outer(x), x)
    torch.testing.assert_close(gx, torch.full_like(x, 2.0), rtol=0, atol=0)


# -- second order ----------------------------------------------------------------------------

@spmd.custom_vjp
def sin(x):
    return torch.sin(x)


sin.defvjp(lambda x: (torch.sin(x), x), lambda x, g: (g * torch.cos(x),))


def test_second_order_with_autograd():
    x = _x(5).requires_grad_()
    (g,) = torch.autograd.grad(sin(x).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(g.detach(), torch.cos(x.detach()), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, -torch.sin(x.detach()), rtol=1e-12, atol=1e-12)


def test_second_order_with_func_grad():
    x = _x(5)
    h = torch.func.grad(lambda x: torch.func.grad(lambda y: sin(y).sum())(x).sum())(x)
    torch.testing.assert_close(h, -torch.sin(x), rtol=1e-12, atol=1e-12)


# -- arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["backward", "autograd.grad"])
def test_non_tensor_args_get_no_gradient(method):
    seen = {}

    @spmd.custom_vjp
    def scale(x, k, mode, z):
        return x * k if mode == "mul" else x + k

    def fwd(x, k, mode, z):
        return scale.fun(x, k, mode, z), (k, mode)

    def bwd(res, g):
        seen["res"] = res
        k, mode = res
        return g * k, None, None, None

    scale.defvjp(fwd, bwd)
    x = _x(3)
    if method == "backward":
        leaf = x.clone().requires_grad_()
        scale(leaf, 2.5, "mul", None).sum().backward()
        gx = leaf.grad
    else:
        leaf = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(scale(leaf, 2.5, "mul", None).sum(), leaf)
    torch.testing.assert_close(gx, torch.full_like(x, 2.5), rtol=0, atol=0)
    assert seen["res"] == (2.5, "mul")


def test_tensor_arg_without_requires_grad_gets_none():
    x, y = _x(3).requires_grad_(), _x(3, seed=1)
    mul(x, y).sum().backward()
    assert y.grad is None and x.grad is not None


def test_func_grad_with_non_tensor_args():
    @spmd.custom_vjp
    def pw(x, p):
        return x ** p

    pw.defvjp(lambda x, p: (x ** p, (x, p)), lambda r, g: (g * r[1] * r[0] ** (r[1] - 1), None))
    x = _x(4).abs() + 0.5
    g = torch.func.grad(lambda x: pw(x, 3).sum())(x)
    torch.testing.assert_close(g, 3 * x ** 2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_nondiff_argnums_are_passed_first_to_bwd(method):
    seen = []

    def fun(a, x, b, y):
        return a * x + b * y

    f = spmd.custom_vjp(fun, nondiff_argnums=(0, 2))

    def fwd(a, x, b, y):
        return fun(a, x, b, y), ("res", x.shape)

    def bwd(a, b, res, g):
        seen.append((a, b, res))
        return 7 * a * g, b * g  # one gradient per differentiable argument (x, y)

    f.defvjp(fwd, bwd)
    x, y = _x(3), _x(3, seed=1)
    gx, gy = _grads(method, lambda x, y: f(2.0, x, 3.0, y), x, y)
    torch.testing.assert_close(gx, torch.full_like(x, 14.0), rtol=0, atol=0)
    torch.testing.assert_close(gy, torch.full_like(y, 3.0), rtol=0, atol=0)
    assert seen == [(2.0, 3.0, ("res", torch.Size([3])))]


def test_nondiff_tensor_arg_gets_no_gradient():
    f = spmd.custom_vjp(lambda t, x: t * x, nondiff_argnums=(0,))
    f.defvjp(lambda t, x: (t * x, None), lambda t, res, g: (g * t,))
    t, x = _x(3).requires_grad_(), _x(3, seed=1).requires_grad_()
    f(t, x).sum().backward()
    assert t.grad is None
    torch.testing.assert_close(x.grad, t.detach(), rtol=0, atol=0)


def test_functools_wrapping_and_methods():
    class Scaler:
        def __init__(self, k):
            self.k = k

        @spmd.custom_vjp
        def apply(self, x):
            """Doc of apply."""
            return x * self.k

    Scaler.apply.defvjp(lambda self, x: (x * self.k, self.k), lambda k, g: (None, g * k * 100))
    assert Scaler.apply.__name__ == "apply" and Scaler.apply.__doc__ == "Doc of apply."
    x = _x(2).requires_grad_()
    Scaler(3.0).apply(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 300.0), rtol=0, atol=0)


# -- errors ----------------------------------------------------------------------------------

def _bad(bwd):
    f = spmd.custom_vjp(lambda x, y: x * y)
    f.defvjp(lambda x, y: (x * y, None), bwd)
    return f


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bwd,got", [(lambda r, g: (g,), 1), (lambda r, g: (g, g, g), 3),
                                     (lambda r, g: (), 0)])
def test_bwd_returning_wrong_number_of_grads(method, bwd, got):
    f = _bad(bwd)
    with pytest.raises(TypeError, match=rf"custom_vjp '<lambda>': bwd returned {got} gradients "
                                        r"for 2 differentiable arguments"):
        _grads(method, f, _x(2), _x(2, seed=1))


def test_wrong_count_with_nondiff_argnums_counts_only_differentiable_args():
    f = spmd.custom_vjp(lambda n, x: n * x, nondiff_argnums=(0,))
    f.defvjp(lambda n, x: (n * x, None), lambda n, res, g: (g, None))
    with pytest.raises(TypeError, match=r"bwd returned 2 gradients for 1 differentiable"):
        f(2.0, _x(2).requires_grad_()).sum().backward()


@pytest.mark.parametrize("method", METHODS)
def test_bwd_returning_a_bare_tensor(method):
    f = _bad(lambda r, g: g)
    with pytest.raises(TypeError, match=r"bwd must return a tuple, got Tensor"):
        _grads(method, f, _x(2), _x(2, seed=1))


def test_call_before_defvjp():
    @spmd.custom_vjp
    def later(x):
        return x + 1

    for x in (_x(2), _x(2).requires_grad_()):
        with pytest.raises(TypeError, match=r"custom_vjp function 'later' has no rule yet; "
                                            r"call \.defvjp\(fwd, bwd\) first"):
            later(x)
    later.defvjp(lambda x: (x + 1, None), lambda r, g: (g,))
    assert torch.equal(later(torch.zeros(1)), torch.ones(1))


# -- when the rule is (not) used --------------------------------------------------------------

def _traced():
    calls = []

    @spmd.custom_vjp
    def f(x):
        calls.append("fun")
        return x * 2

    def fwd(x):
        calls.append("fwd")
        return x * 2, None

    def bwd(res, g):
        calls.append("bwd")
        return (g * 2,)

    f.defvjp(fwd, bwd)
    return f, calls


def test_no_grad_calls_the_plain_function():
    f, calls = _traced()
    x = _x(3).requires_grad_()
    with torch.no_grad():
        y = f(x)
    assert calls == ["fun"] and not y.requires_grad
    with torch.inference_mode():
        f(x)
    assert calls == ["fun", "fun"]


def test_no_input_requiring_grad_calls_the_plain_function():
    f, calls = _traced()
    y = f(_x(3))
    assert calls == ["fun"] and not y.requires_grad


def test_grad_needed_calls_fwd_then_bwd():
    f, calls = _traced()
    x = _x(3).requires_grad_()
    y = f(x)
    assert calls == ["fwd"]
    y.sum().backward()
    assert calls == ["fwd", "bwd"]


def test_func_grad_calls_fwd_and_bwd():
    f, calls = _traced()
    g = torch.func.grad(lambda x: f(x).sum())(_x(3))
    assert "fun" not in calls and "bwd" in calls
    torch.testing.assert_close(g, torch.full((3,), 2.0, dtype=F64), rtol=0, atol=0)


# -- residuals -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_residuals_pytree_of_tensors_and_non_tensors(method):
    seen = []
    marker = object()

    @spmd.custom_vjp
    def f(x, y):
        return x * y, x + y  # a tuple output: bwd gets a tuple of cotangents

    def fwd(x, y):
        a, b = x * y, x + y
        inter = torch.exp(x)  # an intermediate, neither input nor output
        res = {"x": x, "k": 3, "nested": [a, "s", None, (2.5, inter)], "obj": marker, "y": y}
        return (a, b), res

    def bwd(res, gs):
        seen.append(res)
        ga, gb = gs
        assert res["nested"][3][1].shape == res["x"].shape
        return ga * res["y"] * res["k"] + gb, ga * res["x"] + gb

    f.defvjp(fwd, bwd)
    x, y = _x(3), _x(3, seed=1)
    g = _grads(method, lambda x, y: (lambda a, b: a + b)(*f(x, y)), x, y)
    torch.testing.assert_close(g[0], 3 * y + 1, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g[1], x + 1, rtol=1e-12, atol=1e-12)
    (res,) = seen
    assert set(res) == {"x", "k", "nested", "obj", "y"}
    assert res["k"] == 3 and res["obj"] is marker
    n = res["nested"]
    assert isinstance(n, list) and n[1] == "s" and n[2] is None and isinstance(n[3], tuple)
    assert n[3][0] == 2.5
    for t, want in ((res["x"], x), (res["y"], y), (n[0], x * y), (n[3][1], torch.exp(x))):
        assert isinstance(t, torch.Tensor)
        torch.testing.assert_close(t.detach(), want, rtol=0, atol=0)


def test_residual_none_and_empty():
    for res in (None, (), {}, []):
        f = spmd.custom_vjp(lambda x: x + 1)
        f.defvjp(lambda x, res=res: (x + 1, res), lambda r, g, res=res: (g * 3,))
        x = _x(2).requires_grad_()
        f(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 3.0), rtol=0, atol=0)


def test_residuals_do_not_leak_between_threads():
    """Each thread's forward stashes its own residuals (the stash is thread-local)."""
    f = spmd.custom_vjp(lambda x, k: x * k)
    f.defvjp(lambda x, k: (x * k, torch.full_like(x, float(k))), lambda r, g: (g * r, None))
    barrier = threading.Barrier(4)
    out, errors = {}, []

    def work(k):
        try:
            barrier.wait()
            for _ in range(50):
                x = torch.ones(3, dtype=F64, requires_grad=True)
                f(x, k).sum().backward()
                assert torch.equal(x.grad, torch.full((3,), float(k), dtype=F64))
            out[k] = True
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=functools.partial(work, k)) for k in range(1, 5)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not errors, errors
    assert sorted(out) == [1, 2, 3, 4]
