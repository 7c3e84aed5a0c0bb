"""Models (shapes, causality) and the built-in data (deterministic, correct answers)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import MLP, DigitTask, TextTask, Transformer


@pytest.mark.parametrize("hidden", [(8,), (16, 8)])
def test_mlp_shapes(hidden):
    model = MLP(vocab_size=11, out_len=3, hidden=hidden)
    x = jnp.zeros((5, 4), jnp.int32)
    params = model.init(jax.random.key(0), x)["params"]
    assert model.apply({"params": params}, x).shape == (5, 3, 11)
    assert len(params) == len(hidden) + 1


def test_transformer_shapes_and_causality():
    model = Transformer(vocab_size=13, max_len=10, num_layers=2, d_model=16, num_heads=4)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 13, size=(3, 10)).astype(np.int32)
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
    assert sorted(params) == ["block_0", "block_1", "embed", "ln_f", "pos"]
    assert params["block_0"]["attn"]["qkv"]["kernel"].shape == (16, 3, 4, 4)  # (D, q/k/v, heads, head dim)
    assert params["block_0"]["attn"]["proj"]["kernel"].shape == (4, 4, 16)
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
    y = np.asarray(apply(params, x))
    assert y.shape == (3, 10, 13)
    # Changing the tokens after position 5 leaves the logits up to position 5 unchanged: causal attention.
    x2 = x.copy()
    x2[:, 6:] = (x2[:, 6:] + 1) % 13
    y2 = np.asarray(apply(params, x2))
    np.testing.assert_array_equal(y[:, :6], y2[:, :6])
    assert not np.allclose(y[:, 6:], y2[:, 6:])
    # Shorter sequences work (positions are sliced).
    assert apply(params, x[:, :4]).shape == (3, 4, 13)


def test_transformer_errors():
    x = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=re.escape("d_model=30 is not divisible by num_heads=4")):
        Transformer(11, 4, d_model=30, num_heads=4).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=re.escape("the input has 4 positions but max_len=3")):
        Transformer(11, 3, d_model=16, num_heads=2).init(jax.random.key(0), x)


@pytest.mark.parametrize("op", DigitTask.OPS)
@pytest.mark.parametrize("length", [1, 5, 8])
def test_digit_task(op, length):
    task = DigitTask(op, length)
    lm = task.batch(3, 7, 16, "lm")
    win = task.batch(3, 7, 16, "window")
    d = task.digits(3, 7, 16)
    want = np.sort(d, axis=1) if op == "sort" else d[:, ::-1]
    np.testing.assert_array_equal(win["inputs"], d)
    np.testing.assert_array_equal(win["targets"], want)
    # LM layout: digits, SEP, answer, shifted by one; only the answer is scored.
    seq = np.concatenate([d, np.full((16, 1), 10), want], axis=1)
    np.testing.assert_array_equal(lm["inputs"], seq[:, :-1])
    np.testing.assert_array_equal(lm["targets"], seq[:, 1:])
    np.testing.assert_array_equal(lm["mask"], np.repeat([[0] * length + [1] * length], 16, axis=0))
    assert lm["inputs"].shape[1] == task.seq_len("lm") and win["targets"].shape[1] == task.out_len("window")


def test_data_is_a_function_of_seed_and_step():
    task = DigitTask()
    a, b = task.batch(0, 5, 8), task.batch(0, 5, 8)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(task.batch(0, 6, 8)["inputs"], a["inputs"])
    assert not np.array_equal(task.batch(1, 5, 8)["inputs"], a["inputs"])
    assert not np.array_equal(task.batch(0, 5, 8, stream=1)["inputs"], a["inputs"])


def test_text_task(tmp_path):
    path = tmp_path / "t.txt"
    text = bytes(range(32, 127)) * 20
    path.write_bytes(text)
    task = TextTask(str(path), context=8)
    data = np.frombuffer(text, np.uint8)
    lm = task.batch(0, 0, 4, "lm")
    assert lm["inputs"].shape == (4, 8) and task.vocab_size == 256
    np.testing.assert_array_equal(lm["inputs"][:, 1:], lm["targets"][:, :-1])
    for row in lm["inputs"]:  # every window is a slice of the file
        start = int(np.flatnonzero(data == row[0])[0])
        np.testing.assert_array_equal(data[start:start + 8], row)
    win = task.batch(0, 0, 4, "window")
    assert win["inputs"].shape == (4, 8) and win["targets"].shape == (4, 1)
    held = task.batch(0, 0, 64, "lm", stream=1)["inputs"]  # held-out: from the last tenth of the file
    assert held.min() >= data[len(data) * 9 // 10:].min()


def test_data_errors(tmp_path):
    with pytest.raises(ValueError, match=re.escape("DigitTask: op='add' is unknown; use one of ('sort', 'reverse').")):
        DigitTask("add")
    with pytest.raises(ValueError, match=re.escape("DigitTask: length=0 must be an int >= 1.")):
        DigitTask("sort", 0)
    with pytest.raises(ValueError, match=re.escape("DigitTask.batch: layout='seq' is unknown")):
        DigitTask().batch(0, 0, 4, "seq")
    with pytest.raises(ValueError, match=re.escape("DigitTask.digits: batch_size=0 must be >= 1.")):
        DigitTask().batch(0, 0, 0)
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match=re.escape(f"TextTask: path={missing!r} does not exist")):
        TextTask(missing)
    small = tmp_path / "small.txt"
    small.write_bytes(b"abc")
    with pytest.raises(ValueError, match=re.escape("has 3 bytes, too few for windows of context=64")):
        TextTask(str(small))
    with pytest.raises(ValueError, match=re.escape("TextTask: context='8' must be an int >= 1.")):
        TextTask(str(small), context="8")
