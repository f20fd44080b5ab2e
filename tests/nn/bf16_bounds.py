"""Rigorous running-error bounds for a low-precision JAX program, from its own jaxpr.

``error_bounds(fn, *args)`` traces ``fn`` (forward, backward, whatever it is)
to a jaxpr and evaluates that jaxpr once more in float64 while carrying, for
every intermediate ``v`` of the program, an elementwise bound ``e >= |v~ - v|``
on the distance between the value ``v~`` the low-precision program computes
and the value ``v`` of the same program in exact arithmetic (approximated by
the float64 evaluation). Returns the float64 values and the bounds.

The rules, one per primitive, are inequalities, not first-order estimates
(second-order terms such as ``eA * eB`` are carried), with these units:
``u = 2^-8`` (bfloat16, round to nearest), ``u32 = 2^-24`` (float32),
``u64 = 2^-53`` (a float64 program: its bound is then to exact arithmetic, the
float64 replay standing in for it, which the symmetric rules allow) and
``gamma_n = n u / (1 - n u)``.

- rounding to the output dtype (every arithmetic op, a narrowing convert):
  ``|fl(v~) - v| <= e + c |v~| <= (1 + c) e + c |v|`` with ``c = u(out)`` for
  a float32 result, ``u + u32`` for a bfloat16 one (computed in float32 and
  rounded again), plus ``8 u32`` (``8 u64`` for a float64 result) for
  exp/log/logistic/tanh: an *assumed* accuracy of 4 ulps for XLA's
  transcendental functions.
- a product ``a b``: ``eA |b| + |a| eB + eA eB``; a sum: ``eA + eB``;
  ``a / b``: ``(eA + |a/b| eB) / (|b| - eB)``.
- a contraction of K terms (dot_general, ragged_dot_general): the bilinear
  rule above through the same contraction on absolute values, plus the
  float32 accumulation ``gamma_K(u32) * sum |a~| |b~|`` (an *assumption*: XLA
  accumulates bfloat16 products in float32 on CPU and GPU; every contraction in
  the programs checked here asks for float32 explicitly or has float32
  operands; float64 operands accumulate with u64). reduce_sum and scatter-add: the same with the count of addends
  and the output dtype's unit.
- a smooth f: ``e * max |f'|`` over ``[v - e, v + e]`` (exp, log, logistic,
  tanh, powers, rsqrt, pow: each has a closed form).
- gathers, reshapes, selects, slices, max, top-k values: the same map on the
  bounds (1-Lipschitz in the max norm).
- rsqrt and pow: smooth, as above, rounded with the transcendental
  allowance; sin and cos: 1-Lipschitz, plus an *assumed* absolute error of
  ``8 u32`` (4 float32 ulps of 1, their range; ``8 u64`` for float64) on top
  of the rounding, so a result near 0 is covered too.
- scan: its body, walked once per iteration (``lax.scan`` in float64, the
  carries' bounds carried along).
- discrete results (comparisons, sort/top-k indices, integer arithmetic) are
  taken to agree between the two programs: the caller must make sure the
  program has no near-ties (the MoE tests draw inputs with a routing margin).
  ``error_bounds(..., decisions=True)`` measures it instead: for every top-k,
  ``2 max_row(e) / (v_(k) - v_(k+1))`` (the k-th and (k+1)-th largest exact
  values of a row; the selected set agrees when it is below 1), for every
  float comparison ``(eA + eB) / |a - b|`` (0 where both sides are exact, and
  where they are equal in the float64 replay: *taken* to be equal by
  construction, as an element and the max it produced), for
  float sign ``e / |a|``; it returns the largest such ratio per primitive.

A rounding the program skips (XLA may keep float32 excess precision between
fused bf16 ops) only makes the true error smaller, so the bound still holds.

``simulate(fn, key, *args)`` evaluates the same jaxpr in float64 but
perturbs every value the bound rounds by a random relative amount of at most
its ``c``: a brute-force check of the propagation rules (tests/nn/test_bf16_bounds.py).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

U32 = 2.0**-24
UNITS = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11,
         jnp.dtype(jnp.float32): U32, jnp.dtype(jnp.float64): 2.0**-53}
TRANSCENDENTAL = 8  # exp/log/logistic/tanh/...: assumed within 4 ulps, 8 u of the working precision


_REPLAY = [None]  # set by error_bounds(..., replay=True): every unit is u64 (see there)


def _unit(dtype):
    """u of a result of this dtype."""
    return UNITS[jnp.dtype(dtype)] if _REPLAY[0] is None else _REPLAY[0]


def _working_unit(dtype):
    """u of the precision an op of this result dtype computes in (bf16 ops compute in float32)."""
    return min(_unit(dtype), U32)

_STRUCTURAL = {  # linear maps with 0/1 coefficients: apply the same map to the bounds
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
    "dynamic_slice", "concatenate", "gather", "rev", "copy", "copy_p", "optimization_barrier",
    "name", "stop_gradient", "split", "select_n", "scatter", "pad", "reduce_max", "reduce_min",
    "stack", "unstack",
}
_ACCUMULATING = {"dot_general", "ragged_dot_general", "reduce_sum", "scatter-add"}
_ELEMENTWISE = {"add", "sub", "add_any", "mul", "div", "neg", "abs", "max", "min", "exp",
                "log", "logistic", "tanh", "square", "integer_pow", "sign", "rsqrt", "pow",
                "sin", "cos"}
_TRANSCENDENTAL = {"exp", "log", "logistic", "tanh", "rsqrt", "pow", "sin", "cos"}
_COMPARISONS = {"lt", "le", "gt", "ge", "eq", "ne"}
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}


def _is_float(dtype):
    return jnp.issubdtype(dtype, jnp.floating)


def _gamma(n, u):
    return n * u / (1 - n * u)


def _f64_params(params):
    """The primitive's params with every float dtype widened to float64."""
    out = dict(params)
    for key in ("new_dtype", "preferred_element_type", "dtype"):
        if out.get(key) is not None and _is_float(out[key]):
            out[key] = jnp.float64
    if "fill_value" in out and out["fill_value"] is not None:
        out["fill_value"] = 0  # only out-of-range gathers read it; keep bounds finite
    return out


def _bind(prim, params, *args):
    if prim.name == "scatter-add":  # its update_jaxpr is typed: rebuild it for float64
        keys = ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")
        return [lax.scatter_add(*args, **{k: params[k] for k in keys})]
    out = prim.bind(*args, **params)
    return list(out) if prim.multiple_results else [out]


def _dlogistic(t):
    s = jax.nn.sigmoid(t)
    return s * (1 - s)


def _elementwise(name, eqn, vals, errs, out):
    """Propagated bound (before the output's own rounding) of an elementwise op."""
    a, ea = vals[0], errs[0]
    if name in ("add", "sub", "add_any"):
        return ea + errs[1]
    if name in ("neg", "abs"):
        return ea
    if name in ("max", "min"):
        return jnp.maximum(ea, errs[1])
    if name == "sign":
        return jnp.zeros_like(ea)  # taken to agree (no value near 0)
    if name == "mul":
        b, eb = vals[1], errs[1]
        return ea * jnp.abs(b) + jnp.abs(a) * eb + ea * eb
    if name == "div":
        b, eb = vals[1], errs[1]
        den = jnp.abs(b) - eb
        return jnp.where(den > 0, (ea + jnp.abs(out) * eb) / jnp.where(den > 0, den, 1), jnp.inf)
    if name == "square":
        return 2 * jnp.abs(a) * ea + ea * ea
    if name == "integer_pow":
        y = eqn.params["y"]
        if y >= 1:
            return abs(y) * (jnp.abs(a) + ea) ** (y - 1) * ea
        low = jnp.abs(a) - ea
        return jnp.where(low > 0, abs(y) * jnp.where(low > 0, low, 1) ** (y - 1) * ea, jnp.inf)
    if name == "exp":  # exp(a) expm1(e); where that is 0 * inf (a masked -3e38), exp(a + e)
        grow = jnp.exp(a) * jnp.expm1(ea)
        return jnp.where(jnp.isnan(grow), jnp.exp(a + ea), grow)
    if name == "log":
        ok = ea < a
        return jnp.where(ok, -jnp.log1p(-ea / jnp.where(ok, a, 1)), jnp.inf)
    if name == "logistic":  # |sigma'| decreases in |t|
        return ea * _dlogistic(jnp.maximum(jnp.abs(a) - ea, 0))
    if name == "tanh":
        return ea * (1 - jnp.tanh(jnp.maximum(jnp.abs(a) - ea, 0)) ** 2)
    if name in ("sin", "cos"):  # 1-Lipschitz; the assumed absolute accuracy (docstring)
        return ea + TRANSCENDENTAL * _working_unit(eqn.outvars[0].aval.dtype)
    if name == "rsqrt":  # |f'| = x^-1.5 / 2, largest at the interval's low end
        low = a - ea
        return jnp.where(low > 0, 0.5 * jnp.where(low > 0, low, 1) ** -1.5 * ea, jnp.inf)
    if name == "pow":  # x^y, x > 0: |d/dx| = |y| x^(y-1), |d/dy| = x^y |log x|, over the box
        b, eb = vals[1], errs[1]
        lo, hi = a - ea, a + ea
        ok = lo > 0
        lo = jnp.where(ok, lo, 1)
        corners = [lo ** (b - eb), lo ** (b + eb), hi ** (b - eb), hi ** (b + eb)]
        top = functools.reduce(jnp.maximum, corners)
        dx = (jnp.abs(b) + eb) * top / lo  # x^(y-1) <= top / lo
        dy = top * jnp.maximum(jnp.abs(jnp.log(lo)), jnp.abs(jnp.log(hi)))
        return jnp.where(ok, dx * ea + dy * eb, jnp.inf)
    raise NotImplementedError(name)


def _contraction_size(eqn):
    """Addends per output element of an accumulating primitive."""
    name, shape = eqn.primitive.name, eqn.invars[0].aval.shape
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        return math.prod(shape[i] for i in contract)
    if name == "ragged_dot_general":
        (contract, _), _ = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
        return math.prod(shape[i] for i in contract)
    if name == "reduce_sum":
        return math.prod(shape[i] for i in eqn.params["axes"])
    return 1 + math.prod(eqn.invars[2].aval.shape)  # scatter-add: operand + every update


def _accumulating(eqn, params, vals, errs):
    """Propagated bound of a contraction / sum, its accumulation error included."""
    prim, name = eqn.primitive, eqn.primitive.name
    out_dtype = eqn.outvars[0].aval.dtype
    # Contractions accumulate in float32 (module docstring); sums in their own dtype.
    unit = _unit(out_dtype)
    if name in ("dot_general", "ragged_dot_general"):  # float32 accumulation, float64 for f64
        unit = _working_unit(max((v.aval.dtype for v in eqn.invars[:2]), key=lambda d: UNITS[d]))
    g = _gamma(_contraction_size(eqn), unit)
    absv = [jnp.abs(v) if e is not None else v for v, e in zip(vals, errs)]
    big = [a + e if e is not None else a for a, e in zip(absv, errs)]
    if name in ("dot_general", "ragged_dot_general"):
        (a, b), (ea, eb) = absv[:2], errs[:2]
        rest = vals[2:]
        lin = (_bind(prim, params, ea, b, *rest)[0] + _bind(prim, params, a, eb, *rest)[0]
               + _bind(prim, params, ea, eb, *rest)[0])
        return lin + g * _bind(prim, params, big[0], big[1], *rest)[0]
    if name == "reduce_sum":
        return _bind(prim, params, errs[0])[0] + g * _bind(prim, params, big[0])[0]
    operand, idx, upd = errs[0], vals[1], errs[2]
    return (_bind(prim, params, operand, idx, upd)[0]
            + g * _bind(prim, params, big[0], idx, big[2])[0])


def _round_coefficient(name, in_dtype, out_dtype):
    """c of the output's rounding ``(1 + c) e + c |v|`` (module docstring)."""
    if not _is_float(out_dtype):
        return None
    u = _unit(out_dtype)
    if name == "convert_element_type":
        narrowing = _is_float(in_dtype) and UNITS[jnp.dtype(in_dtype)] < UNITS[jnp.dtype(out_dtype)]
        return u if narrowing else 0.0  # int -> float is exact for the small ints here
    if name in _STRUCTURAL or name in ("neg", "abs", "max", "min", "sign"):
        return 0.0
    if name in ("dot_general", "ragged_dot_general", "reduce_sum", "scatter-add"):
        # gamma already holds the float32 rounding; a bf16 result is rounded again.
        return u if u > U32 else 0.0
    c = u + (U32 if u > U32 else 0.0)
    if name in _TRANSCENDENTAL:
        c += TRANSCENDENTAL * _working_unit(out_dtype)
    return c


class _Walk:
    """What a walk carries besides values and bounds: the random perturbation
    (``simulate``; None for ``error_bounds``) and the decision ratios found so far."""

    def __init__(self, key=None):
        self.key, self.count, self.notes = key, 0, []

    def perturb(self, shape):
        """Uniform in [-1, 1], a fresh key per use."""
        self.count += 1
        return jax.random.uniform(jax.random.fold_in(self.key, self.count), shape,
                                  jnp.float64, -1.0, 1.0)

    def child(self, i):
        """The walk of a scan body's iteration ``i`` (a traced index): its own keys."""
        self.count += 1
        key = None if self.key is None else jax.random.fold_in(
            jax.random.fold_in(self.key, self.count), i)
        return _Walk(key)


def _full(err, aval):
    """A float value's bound as an array of its shape (None stays None for non-floats)."""
    if not _is_float(aval.dtype):
        return None
    return jnp.broadcast_to(jnp.zeros(()) if err is None else err, aval.shape).astype(jnp.float64)


def _scan(eqn, vals, errs, walk):
    """The body walked once per iteration, the carries' bounds carried (lax.scan)."""
    p = eqn.params
    body = p["jaxpr"]
    if "num_consts" in p:
        nc, nk = p["num_consts"], p["num_carry"]
    else:  # newer jax: the (consts, carry, xs) grouping is a flat tree of the operands
        consts, carry, _ = p["ft_in"].update(list(range(len(vals)))).unpack()
        nc, nk = len(list(consts)), len(list(carry))
    errs = [_full(e, v.aval) for e, v in zip(errs, eqn.invars)]
    consts = vals[:nc], errs[:nc]

    names = []  # the decisions' primitives, in the order the body meets them

    def step(carry, x):
        (cv, ce), (xv, xe, i) = carry, x
        sub = walk.child(i)
        outs, oerrs = _eval_jaxpr(body, [*consts[0], *cv, *xv], [*consts[1], *ce, *xe], sub)
        outs = [jnp.asarray(o, v.dtype) for o, v in zip(outs, [*cv, *outs[nk:]])]
        oerrs = [_full(e, v.aval) for e, v in zip(oerrs, body.jaxpr.outvars)]
        names[:] = [name for name, _ in sub.notes]
        return (outs[:nk], oerrs[:nk]), (outs[nk:], oerrs[nk:], [r for _, r in sub.notes])

    init = ([lax.convert_element_type(v, v.dtype) for v in vals[nc:nc + nk]], errs[nc:nc + nk])
    xs = (vals[nc + nk:], errs[nc + nk:], jnp.arange(p["length"]))
    (cv, ce), (yv, ye, notes) = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"])
    walk.notes += [(name, jnp.max(r)) for name, r in zip(names, notes)]
    return [*cv, *yv], [*ce, *ye]


def _decision(name, eqn, vals, errs):
    """The largest ratio (bound / margin) of a decision; below 1: it agrees (docstring)."""
    if name == "top_k":
        k, n = eqn.params["k"], eqn.invars[0].aval.shape[-1]
        if k == n:
            return None
        s = -jnp.sort(-vals[0], axis=-1)
        gap, tol = s[..., k - 1] - s[..., k], 2 * jnp.max(errs[0], axis=-1)
        return jnp.max(jnp.where(tol > 0, tol / gap, 0.0))
    if name in _COMPARISONS and _is_float(eqn.invars[0].aval.dtype):
        a, b = vals
        ea, eb = (jnp.zeros(()) if e is None else e for e in errs)
        tol, gap = ea + eb, jnp.abs(a - b)  # a tie in the replay: equal by construction
        return jnp.max(jnp.where((tol > 0) & (gap > 0), tol / jnp.where(gap > 0, gap, 1), 0.0))
    if name == "sign" and _is_float(eqn.invars[0].aval.dtype):
        return jnp.max(jnp.where(errs[0] > 0, errs[0] / jnp.abs(vals[0]), 0.0))
    return None


def _eval_eqn(eqn, vals, errs, walk):
    name, prim = eqn.primitive.name, eqn.primitive
    if name in _CALLS:
        inner = eqn.params[_CALLS[name]]
        closed = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())
        return _eval_jaxpr(closed, vals, errs, walk)
    if name == "scan":
        return _scan(eqn, vals, errs, walk)
    if any(e is not None for e in errs):
        ratio = _decision(name, eqn, vals, errs)
        if ratio is not None:
            walk.notes.append((name, ratio))
    params = _f64_params(eqn.params)
    outs = _bind(prim, params, *vals)
    if all(e is None for e in errs):  # integer / boolean / constant-only work
        prop = [None if not _is_float(o.aval.dtype) else jnp.zeros(o.aval.shape)
                for o in eqn.outvars]
    elif name == "convert_element_type":
        prop = [errs[0] if _is_float(eqn.outvars[0].aval.dtype) else None]
    elif name in _STRUCTURAL:
        if name in ("reduce_max", "reduce_min"):  # 1-Lipschitz in the max norm
            prop = _bind(lax.reduce_max_p, params, errs[0])
        else:
            args = [e if e is not None else v for v, e in zip(vals, errs)]
            prop = _bind(prim, params, *args)
    elif name in _ACCUMULATING:
        prop = [_accumulating(eqn, params, vals, errs)]
    elif name in ("top_k", "sort"):
        axis = eqn.params.get("axis", eqn.params.get("dimension", -1))
        prop = []
        for o, e in zip(eqn.outvars, (errs * len(eqn.outvars))[: len(eqn.outvars)]):
            if _is_float(o.aval.dtype):  # sorted values: 1-Lipschitz in the max norm
                row = jnp.max(errs[0], axis=axis, keepdims=True)
                prop.append(jnp.broadcast_to(row, o.aval.shape))
            else:
                prop.append(None)
    elif name in _ELEMENTWISE:
        errs = [e if e is not None else jnp.zeros(jnp.shape(v)) for v, e in zip(vals, errs)]
        prop = [_elementwise(name, eqn, vals, errs, outs[0])]
    elif not any(_is_float(o.aval.dtype) for o in eqn.outvars):
        prop = [None] * len(outs)  # comparisons and the like: decisions taken to agree
    else:
        raise NotImplementedError(f"no error rule for primitive {name!r}")
    in_dtype = eqn.invars[0].aval.dtype if eqn.invars else None
    res_v, res_e = [], []
    for o, v, e in zip(eqn.outvars, outs, prop):
        c = _round_coefficient(name, in_dtype, o.aval.dtype)
        if name == "integer_pow" and c:  # |y| multiplies and a reciprocal, each rounded
            c *= abs(eqn.params["y"]) + 1
        if e is not None and c:
            if walk.key is None:
                e = (1 + c) * e + c * jnp.abs(v)
            else:
                v = v * (1 + c * walk.perturb(v.shape))
        res_v.append(v)
        res_e.append(e)
    return res_v, res_e


def _eval_jaxpr(closed, args, arg_errs, walk):
    env = {}

    def read(var):
        if isinstance(var, jcore.Literal):
            val = var.val
            if _is_float(var.aval.dtype):  # the constant as the program holds it (0.01 -> f32)
                return jnp.asarray(np.asarray(val, var.aval.dtype).astype(np.float64)), jnp.zeros(())
            return jnp.asarray(val, var.aval.dtype), None
        return env[var]

    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        c = np.asarray(c)
        env[var] = ((jnp.asarray(c, np.float64), jnp.zeros(c.shape)) if _is_float(c.dtype)
                    else (jnp.asarray(c), None))
    for var, v, e in zip(closed.jaxpr.invars, args, arg_errs):
        env[var] = (v, e)
    for eqn in closed.jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs, errs = _eval_eqn(eqn, [v for v, _ in ins], [e for _, e in ins], walk)
        for var, v, e in zip(eqn.outvars, outs, errs):
            if not isinstance(var, jcore.DropVar):
                env[var] = (v, e)
    got = [read(v) for v in closed.jaxpr.outvars]
    return [v for v, _ in got], [e for _, e in got]


def _run(fn, args, key=None):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat = jax.tree_util.tree_leaves(args)
    out_tree = jax.tree_util.tree_structure(out_shape)

    def body(flat, key):
        walk = _Walk(key)
        vals = [jnp.asarray(x, np.float64) if _is_float(jnp.result_type(x)) else jnp.asarray(x)
                for x in flat]
        errs = [jnp.zeros(jnp.shape(x)) if _is_float(jnp.result_type(x)) else None
                for x in flat]
        v, e = _eval_jaxpr(closed, vals, errs, walk)
        zeros = [jnp.zeros(jnp.shape(x)) if e is None else e for x, e in zip(v, e)]
        worst = {}
        for name, ratio in walk.notes:
            worst[name] = ratio if name not in worst else jnp.maximum(worst[name], ratio)
        return v, zeros, worst

    np_flat = [np.asarray(x, np.float64) if _is_float(jnp.result_type(x)) else np.asarray(x)
               for x in flat]
    with jax.enable_x64(True):
        v, e, worst = jax.jit(body)(np_flat, key)
        v, e = [np.asarray(x) for x in v], [np.asarray(x) for x in e]
    worst = {k: float(r) for k, r in worst.items()}
    return (jax.tree_util.tree_unflatten(out_tree, v), jax.tree_util.tree_unflatten(out_tree, e),
            worst)


def error_bounds(fn, *args, decisions=False, replay=False):
    """``(values, bounds)``: pytrees like ``fn(*args)``, float64 NumPy.

    ``values`` is ``fn``'s program evaluated in float64 (the inputs taken as
    exact); ``bounds`` bounds elementwise ``|fn(*args) - values|`` for the
    program run in its own dtypes (module docstring: rules and assumptions).
    With ``decisions``, also ``{primitive: largest bound / margin}`` over the
    program's float decisions (top-k sets, comparisons, signs): the bounds hold
    only where every ratio is below 1.

    With ``replay``, the bounds are those of the float64 replay itself (the
    returned ``values``) to the program in exact arithmetic: the same rules
    with every unit ``u64 = 2^-53`` (every op, every accumulation, the
    transcendental allowance ``8 u64``). Two programs that compute the same
    function in exact arithmetic have replays within the sum of these bounds.
    """
    _REPLAY[0] = 2.0**-53 if replay else None
    try:
        values, bounds, worst = _run(fn, args)
    finally:
        _REPLAY[0] = None
    return (values, bounds, worst) if decisions else (values, bounds)


def simulate(fn, seed, *args):
    """``fn``'s program in float64 with each rounding the bound counts replaced by
    a random relative perturbation of at most its coefficient ``c``."""
    with jax.enable_x64(True):
        key = jax.random.key(seed)
    return _run(fn, args, key)[0]


def within_bound(got, want, bound, what):
    """Assert ``|got - want| <= bound`` elementwise; return max |got - want| / bound."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = np.asarray(bound)
    assert got.shape == want.shape == bound.shape, what
    err = np.abs(got - want)
    ratio = float(np.max(err / np.maximum(bound, np.finfo(np.float64).tiny)))
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (
        f"{what}: |err| {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst} (max ratio {ratio:.3f})")
    return ratio
