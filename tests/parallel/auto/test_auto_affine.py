"""``auto_layout``'s one-device profile at a new micro-batch size derived from its compiles at two others
(``spmd.parallel.cost._affine``: the step's flops, bytes accessed and operations are affine in the rows where
its program and work are), against the step compiled at that size; refused where the work is not affine; and
a measured candidate whose state comes back in equivalent shardings is not compiled again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import Transformer
from spmd.parallel import Layout
from spmd.parallel.auto._auto import default_loss
from spmd.parallel.auto._measure import _built, compiled_warm
from spmd.parallel.cost._memory import Profile

OPT = optax.adamw(1e-3)


def _batch(rows: int, t: int = 16) -> dict:
    return {"inputs": jax.ShapeDtypeStruct((rows, t), jnp.int32), "targets": jax.ShapeDtypeStruct((rows, t), jnp.int32)}


@pytest.mark.slow  # five one-device compiles
def test_the_step_at_new_rows_is_derived_from_two_compiles_as_xla_compiles_it():
    model = Transformer(vocab_size=12, d_model=32, num_heads=2, num_layers=2, max_len=16)
    params = jax.eval_shape(lambda x: model.init(jax.random.key(0), x)["params"], _batch(8)["inputs"])
    prof = Profile(default_loss(model), params, OPT)
    ref = Profile(default_loss(model), params, OPT)  # every size compiled: the reference
    for rows in (8, 16):
        assert prof._step(_batch(rows)) == ref._step(_batch(rows))
    got = prof._step(_batch(48))
    assert got[2] is None  # derived: no temp bytes
    ref.in_batch.derived = lambda batch: None  # compiled at 48 rows
    want = ref._step(_batch(48))
    assert abs(got[0] - want[0]) <= 1e-5 * want[0]  # flops
    assert abs(got[1] - want[1]) <= 1e-3 * want[1]  # bytes accessed
    assert got[3] == want[3]  # operations
    # another sequence length is another program: compiled, not derived from the 16-token ones
    assert prof._step(_batch(8, 8)) == ref._step(_batch(8, 8))  # compiled: XLA's own figures, temp bytes too


def test_a_step_whose_work_is_not_affine_in_the_rows_is_compiled():
    params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}

    def loss(p, b):  # a [rows, rows] matmul: its flops grow with the square of the rows
        h = b["x"] @ p["w"]
        return jnp.mean(h @ h.T)

    prof = Profile(loss, params, optax.sgd(0.1))
    for rows in (4, 8):
        prof._step({"x": jax.ShapeDtypeStruct((rows, 4), jnp.float32)})
    got = prof._step({"x": jax.ShapeDtypeStruct((16, 4), jnp.float32)})
    fresh = Profile(loss, params, optax.sgd(0.1))  # no two sizes seen: it can only compile
    assert got == fresh._step({"x": jax.ShapeDtypeStruct((16, 4), jnp.float32)})  # compiled, as XLA gives it
    # the affine guess from 4 and 8 rows is 3x the 8-row step's extra flops, not the 16-row step's
    f4, f8 = (prof._step({"x": jax.ShapeDtypeStruct((r, 4), jnp.float32)})[0] for r in (4, 8))
    assert got[0] > f4 + (f8 - f4) * 3 * 1.2


def test_a_state_back_in_equivalent_shardings_is_not_compiled_again():
    model = Transformer(vocab_size=12, d_model=32, num_heads=2, num_layers=1, max_len=16)
    batch = {"inputs": np.zeros((16, 16), np.int32), "targets": np.zeros((16, 16), np.int32)}
    params = jax.eval_shape(lambda x: model.init(jax.random.key(0), x)["params"], batch["inputs"])
    lay = Layout(dp=2, fsdp=4, units=("block_0",), reshard_after_forward=False)
    step, state, b = _built(model, OPT, default_loss, params, batch, jax.devices(), lay)
    comp = step.lower(state, b).compile()
    outs = jax.tree.leaves(comp.output_shardings[0])
    ins = [x.sharding for x in jax.tree.leaves(state)]
    assert any(i != o for i, o in zip(ins, outs))  # spelled otherwise (P('fsdp', None) back as P('fsdp',))
    assert all(i.is_equivalent_to(o, x.ndim) for i, o, x in zip(ins, outs, jax.tree.leaves(state)))
    got, state, relaid = compiled_warm(step, state, b, comp)
    assert not relaid and got is comp
    state, m = got(state, b)  # the same executable takes the state it returned
    jax.block_until_ready(m)


def test_the_profiles_compiles_and_timings_are_named_before_they_start():
    params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    prof = Profile(lambda p, b: jnp.mean(b["x"] @ p["w"]), params, optax.sgd(0.1))
    said = []
    prof.progress = lambda text: said.append((text, len(prof._grad), len(prof._timed)))
    x = lambda rows: {"x": jax.ShapeDtypeStruct((rows, 4), jnp.float32)}  # noqa: E731
    prof._step(x(4))
    prof._step(x(8))
    prof._step(x(4))  # cached: nothing said
    prof._step(x(12))  # derived: nothing compiled, nothing said
    prof.grad_seconds(x(2), jax.devices()[:2], rounds=1)
    assert said == [("compiling its one-device step at 4x4 rows", 0, 0),  # said before its entry exists
                    ("compiling its one-device step at 8x4 rows", 1, 0),
                    ("timing the one-device gradient at 2x4 rows on 2 devices at once", 3, 0)]


def test_measure_layouts_says_when_the_rounds_start(monkeypatch):
    from spmd.parallel.auto import _measure

    events = []

    class Fake:
        def __init__(self, *a, **k):
            self.seconds, self.peak = [], 1
            events.append("built")

        def round(self, steps):
            events.append("round")
            self.seconds.append(1.0)

    monkeypatch.setattr(_measure, "_Timed", Fake)
    lays = [Layout(dp=8), Layout(fsdp=8, units=("u",))]
    _measure.measure_layouts(None, None, None, None, None, [], lays, rounds=1, max_rounds=1,
                             progress=lambda lay: events.append(lay))
    assert events == [lays[0], "built", lays[1], "built", None, "round", "round"]


def test_the_bar_names_the_profiles_work_under_its_own_until_closed(capsys):
    from spmd.parallel.auto._progress import _bar, measuring, now

    class Prof:
        progress = None

    prof = Prof()
    bar = _bar(3, "auto_layout on 8 devices: layouts", under=prof)  # stderr is not a terminal here: lines
    now(bar, "tracing dp=4,cp=2")
    prof.progress("compiling its one-device step at 32x8 rows")
    now(bar, "timing the optimizer update of dp=8", 0)  # not counted: not what the profile's work is named under
    prof.progress("compiling its one-device step at 16x16 rows")
    bar.close()
    prof.progress("compiling its one-device step at 64x4 rows")  # the bar is closed: nothing
    bar = _bar(2, "auto_layout: timing the top 2 of 9")
    show = measuring(bar, 2)
    show(Layout(dp=8))
    show(None)
    assert capsys.readouterr().err.splitlines() == [
        "auto_layout on 8 devices: layouts [1/3] tracing dp=4,cp=2",
        "auto_layout on 8 devices: layouts [1/3] tracing dp=4,cp=2: compiling its one-device step at 32x8 rows",
        "auto_layout on 8 devices: layouts [1/3] timing the optimizer update of dp=8",
        "auto_layout on 8 devices: layouts [1/3] tracing dp=4,cp=2: compiling its one-device step at 16x16 rows",
        "auto_layout: timing the top 2 of 9 [1/2] compiling dp=8",
        "auto_layout: timing the top 2 of 9 [1/2] timing the 2 side by side, in rounds"]
