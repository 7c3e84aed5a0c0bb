"""How the job lays out the project's own models with ``spmd.parallel``: model knowledge, in one place.

- ``shard_units(model)``: the ``fully_shard`` units (torch's ``fully_shard`` on each block / layer);
- ``transformer_tp_plan(sequence_parallel)``: Megatron-LM's plan of ``models.Transformer`` for
  ``parallelize_module``: a vocabulary-parallel embedding and its tied output projection ``embed.attend``
  (column-parallel on the vocabulary, the logits gathered: the loss and accuracy then need no
  collective; the digit task's vocabulary is tiny), the attention's ``qkv`` column-parallel on the heads (its ``DenseGeneral``
  kernel is ``(D, 3, H, D/H)``: ``dim=2``), ``proj`` row-parallel on its heads input (kernel
  ``(H, D/H, D)``, input ``(b, t, H, D/H)`` cut on dim 2), the MLP's ``fc`` column- and ``fc_out``
  row-parallel; with sequence parallelism the norms run on the device's positions and the activations
  between the blocks stay cut on the sequence (``Shard(1)``). ``spmd.parallel`` cuts evenly only, so a
  vocabulary the tp size does not divide (the digit task's 11 tokens over tp=4) keeps the embedding whole
  (replicated; under sequence parallelism its output is then cut on the sequence, a local slice);
- ``decoder_tp_plan(model)``: Megatron's plan of the Llama / MoE decoder (attention and dense MLP projections),
  its blocks ``layers_*`` or their ``nn.scan`` stack ``layers`` (``decoder_blocks``);
- ``layout_model(model, mesh, sequence_parallel)``: the model wrapped for a job mesh of ``dp`` / ``fsdp``
  / ``tp`` / ``ep`` dims (a plain model for ``dp`` only: DDP over ``mesh``).
"""

from __future__ import annotations

from typing import Any

from placements import Replicate, Shard
from spmd import DeviceMesh
from spmd.parallel import (ColwiseParallel, ExpertParallel, ExpertTensorParallel, PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                           fully_shard, parallelize_module, weight_stationary_plan)

__all__ = ["shard_units", "decoder_blocks", "reshard_after_forward", "transformer_tp_plan", "decoder_tp_plan", "layout_model", "DATA"]

DATA = ("dp", "fsdp")  # the mesh dims the batch is split over


def shard_units(model: Any) -> list[str]:
    """The ``fully_shard`` units of a project model: each transformer block, each MLP layer."""
    from models._llama import Llama
    from models._mlp import MLP
    from models._moe import MoE
    from models._transformer import Transformer

    if isinstance(model, Transformer):
        return ["block_*"]
    if isinstance(model, MLP):
        return ["hidden_*", "out"]
    if isinstance(model, (Llama, MoE)):
        return [decoder_blocks(model)]
    raise TypeError(f"shard_units: model={type(model).__name__} is not a project model (Transformer, MLP, Llama, "
                    "MoE).")


def decoder_blocks(model: Any) -> str:
    """The glob of a Llama / MoE decoder's blocks: ``layers_*``, or ``layers`` (its ``nn.scan`` stack, a unit
    sequence of its own, when ``scan_layers``)."""
    return "layers" if getattr(model.cfg, "scan_layers", False) else "layers_*"


def reshard_after_forward(model: Any) -> bool:
    """Whether ``fully_shard`` gathers a project model's units again for their backward pass.

    The transformer: yes (torch's default): one block's parameters alive at a time, for one more all-gather
    per buffer. The MLP: no, each layer's gathered parameters are kept for its backward pass: resharding
    would save almost nothing and make the step's all-gathers differ from the plan's table. Its last layer
    ``out`` (the largest) runs its backward pass right after its forward pass, so it is alive either way;
    ``hidden_0`` reads a one-hot of integer tokens, which has no gradient, so its kernel is not read
    backward (XLA drops that re-gather); the biases are never read backward (dropped too). Only
    ``hidden_1``'s kernel would be gathered again. Keeping them all costs the gathered bytes of
    ``hidden_*`` on top of ``out``'s.
    """
    from models._mlp import MLP

    return not isinstance(model, MLP)


_model_default = reshard_after_forward  # layout_model's keyword of the same name shadows it


def transformer_tp_plan(sequence_parallel: bool = False, *, vocab_size: int | None = None,
                        tp_size: int | None = None) -> dict:
    """The Megatron (sequence-parallel) plan of ``models.Transformer`` (see the module doc).

    ``vocab_size`` / ``tp_size``: when given and ``tp_size`` does not divide ``vocab_size``, the embedding
    stays whole (``spmd.parallel`` refuses uneven tensor-parallel cuts)."""
    vocab_parallel = vocab_size is None or tp_size is None or vocab_size % tp_size == 0
    if not sequence_parallel:
        plan = {
            "embed": RowwiseParallel(),  # vocabulary-parallel lookup, output whole
            "block_*.attn.qkv": ColwiseParallel(dim=2),  # kernel (D, 3, H, D/H): cut the heads
            "block_*.attn.proj": RowwiseParallel(input_layouts=Shard(2)),  # input (b, t, H, D/H) cut on the heads
            "block_*.fc": ColwiseParallel(),
            "block_*.fc_out": RowwiseParallel(),
            "embed.attend": ColwiseParallel(output_layouts=Replicate()),  # the tied head on the vocabulary rows
        }
        if not vocab_parallel:
            del plan["embed"], plan["embed.attend"]
        return plan
    return {
        "embed": (RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) if vocab_parallel else
                  PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))),
        "block_*.ln1": SequenceParallel(),
        "block_*.ln2": SequenceParallel(),
        "ln_f": SequenceParallel(),
        "block_*.attn.qkv": ColwiseParallel(dim=2, input_layouts=Shard(1)),
        "block_*.attn.proj": RowwiseParallel(input_layouts=Shard(2), output_layouts=Shard(1)),
        "block_*.fc": ColwiseParallel(input_layouts=Shard(1)),
        "block_*.fc_out": RowwiseParallel(output_layouts=Shard(1)),
        **({"embed.attend": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())} if vocab_parallel else {}),
    }


def decoder_tp_plan(model: Any) -> dict | None:
    """Megatron's plan of the Llama / MoE decoder's blocks (``models._llama``), or None for another model: the
    attention's ``q_proj`` / ``k_proj`` / ``v_proj`` column-parallel (on the heads), ``o_proj`` row-parallel; the
    dense MLP blocks' ``gate_proj`` / ``up_proj`` column- and ``down_proj`` row-parallel (an MoE with experts in
    every block has none: its experts go over ep, its router stays whole)."""
    from models._llama import Llama
    from models._moe import MoE

    if not isinstance(model, (Llama, MoE)):
        return None
    blocks = decoder_blocks(model)
    plan = {f"{blocks}.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan[f"{blocks}.self_attn.o_proj"] = RowwiseParallel()
    if isinstance(model, Llama) or model.cfg.moe_every > 1:
        plan.update({f"{blocks}.mlp.gate_proj": ColwiseParallel(), f"{blocks}.mlp.up_proj": ColwiseParallel(),
                     f"{blocks}.mlp.down_proj": RowwiseParallel()})
    return plan


def layout_model(model: Any, mesh: DeviceMesh, *, sequence_parallel: bool = False, weight_stationary: bool = False,
                 reshard_after_forward: bool | None = None) -> Any:
    """``model`` laid out for ``mesh`` (dims from ``dp``, ``fsdp``, ``tp``), through the public contract.

    ``tp``: ``parallelize_module`` with the transformer's plan (``weight_stationary``: its sequence-parallel
    plan with the cuts moved to the batch, ``spmd.parallel.weight_stationary_plan``); ``fsdp``:
    ``fully_shard`` over the data dims (2-D ``dp, fsdp``: HSDP), each block / layer a unit, resharded after
    its forward pass as ``reshard_after_forward`` says (None: the model's default, the function
    ``reshard_after_forward(model)``); neither: the model itself
    (DDP: give ``mesh=`` to ``init_train_state`` / ``make_train_step``). ``spmd.parallel.apply_layout`` of the
    ``Layout`` with these plans and units builds the same.
    """
    from models._transformer import Transformer

    names = mesh.mesh_dim_names
    out = model
    if "ep" in names:  # the MoE blocks' experts cut over ep, their tokens exchanged with all-to-alls
        out = parallelize_module(out, mesh["ep"], {f"{decoder_blocks(model)}.mlp.experts": ExpertParallel()})
    if "tp" in names:
        plan = decoder_tp_plan(model) if not isinstance(model, Transformer) else None
        if plan is None and not isinstance(model, Transformer):
            raise ValueError(f"models.train: a mesh with a 'tp' dim runs a model's tensor-parallel plan; "
                             f"{type(model).__name__} has none: use --model transformer, llama or moe, or a mesh "
                             "without tp.")
        if plan is not None and (sequence_parallel or weight_stationary):
            raise ValueError(f"models.train: --sequence-parallel / --weight-stationary cut the transformer's "
                             f"activations; {type(model).__name__}'s tp plan (its attention and MLP projections) has "
                             "no such form: drop the flag, or use --model transformer.")
        if plan is not None and "ep" in names and model.cfg.intermediate_size % mesh.size("tp") == 0 and hasattr(
                model.cfg, "num_experts"):  # the experts' own tp inside ep: their hidden f cut over tp
            plan[f"{decoder_blocks(model)}.mlp.experts"] = ExpertTensorParallel(
                model_dim=model.cfg.hidden_size)
        if plan is None:
            plan = transformer_tp_plan(sequence_parallel or weight_stationary, vocab_size=model.vocab_size,
                                       tp_size=mesh.size("tp"))
        out = parallelize_module(out, mesh["tp"], weight_stationary_plan(plan) if weight_stationary else plan)
    if "fsdp" in names:
        data = tuple(n for n in names if n in DATA)
        out = fully_shard(out, mesh=mesh[data] if len(data) > 1 else mesh["fsdp"], units=shard_units(model),
                          reshard_after_forward=(_model_default(model) if reshard_after_forward is None
                                                 else reshard_after_forward))
    return out
