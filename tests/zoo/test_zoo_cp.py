"""Context parallelism on a zoo decoder nobody here wrote: Hugging Face's ``FlaxMistralForCausalLM`` (its own
attention: RoPE from ``position_ids``, a causal-mask buffer, flax's ``dot_product_attention_weights``) under cp=2
and dp=2 x cp=2, each layer's attention module run on the sequence gathered over cp (its all-ones padding mask,
a constant, not gathered), equal to 10 AdamW steps on one device within 1e-5 (losses, parameters and the
optimizer state, as ``test_zoo.assert_state_matches`` compares them), the compiled step's collectives equal to the
table. The same for Hugging Face's ``FlaxGPT2LMHeadModel``: its head tied to the
token table through a ``Dense`` (the table's gradient all-reduced over cp for the head's part: the traced step
multiplies by it) and its position ids looked up beside the tokens (the two lookups' outputs summed: one
cotangent, gathered over cp once for both tables' transposes)."""

import numpy as np
import pytest

import spmd
from spmd.parallel import executed_collectives, init_train_state, make_train_step, unshard_params, unshard_tree
from tests.zoo.test_zoo import FAMILIES, OPT, STEPS, _reference, _variables, assert_state_matches


def _assert_table_is_hlo(comm, hlo):
    for kind in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"):
        want = comm["total"].get(kind, {"count": 0, "bytes": 0})
        assert (hlo[kind]["buffers"], hlo[kind]["bytes"]) == (want["count"], want["bytes"]), kind


@pytest.mark.slow
@pytest.mark.parametrize("name,dims,attn", [
    ("hf_mistral", {"cp": 2}, "model.layers.*.self_attn"),
    ("hf_mistral", {"dp": 2, "cp": 2}, "model.layers.*.self_attn"),
    ("hf_gpt2", {"cp": 2}, "transformer.h.*.attn"),
    ("hf_gpt2", {"dp": 2, "cp": 2}, "transformer.h.*.attn"),
], ids=["hf_mistral-cp2", "hf_mistral-dp2-cp2", "hf_gpt2-cp2", "hf_gpt2-dp2-cp2"])
def test_zoo_decoder_under_cp_equals_one_device(name, dims, attn):
    fam = FAMILIES[name]
    mesh = spmd.init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    model = fam.build()
    params, _ = _variables(fam, model)
    batch = fam.batch(0)
    state = init_train_state(model, OPT, params=params, mesh=mesh)
    step = make_train_step(model, fam.loss(model), OPT, mesh=mesh)
    comm = step.communication(state, batch)
    hlo = executed_collectives(step._build(state.plan).jitted, state, batch, scalars=False)
    print(step.table(state, batch).splitlines()[-8:])
    losses = []
    for _ in range(STEPS):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    ref_losses, ref = _reference(name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert_state_matches(unshard_params(model, state), unshard_tree(state.opt_state, state.plan, optimizer=OPT), ref)
    assert [r["call"] for r in comm["attention"]] == [attn.replace("*", str(i)) for i in range(2)]
    _assert_table_is_hlo(comm, hlo)
