"""A pass over the lowered program: parameters gathered for forward are dropped once used (FSDP's
reshard-after-forward, ZeRO-3's point), and gathered again for backward.

Autograd keeps what an op needs for its backward, a gathered weight included: without this pass every
group's whole parameters stay alive from forward to backward, as much memory as data parallelism. With
it, each group except the last (its backward comes first, at once) is released after the statement that
last reads it (`del`), and the generated forward runs under saved-tensor hooks
(`ParameterSync.resharded_after_forward`) that keep, for a resharded group's weights, where they lie in
the group instead of their bytes. Backward gathers the group again when it first needs one of them,
the group before it prefetched meanwhile, so two groups at most are whole at a time in either phase.

A group whose weights no op keeps for backward (an embedding's table: its backward reads the indices
only) is released the same way and never gathered again. Compile applies the pass unless the plan keeps
within its memory bound without it (compiler._lowered): re-gathering costs one all-gather per group.
"""

from __future__ import annotations

import dataclasses

import torch

from pardsl.layouts.algebra import B
from pardsl.model.in_place import is_view
from pardsl.planning.inference import TypedGraph
from pardsl.program.ir import Collective, Instruction, LoweredProgram, Statement, Var


def reshard_after_forward(program: LoweredProgram, typed: TypedGraph, any_axis: bool = False) -> LoweredProgram:
    """The program with its FSDP groups but the last released after their last use in forward and, where an
    op keeps one of their weights for backward, gathered again there; the program itself where there is
    none. An FSDP group gathers, over an axis that splits the batch, parameters that are then whole on every
    rank (ZeRO-3's shards of a replica); a tensor-parallel scheme's weight gathered on one axis and still
    split on another (2-D, 2.5-D) stays gathered, as the schemes do. `any_axis`: every group, whichever
    axis and whether whole or not, as the search counts gathered memory (two groups at a time) for a plan
    under a memory bound (a searched plan that splits the batch only after the embedding, or stores a
    weight split over one axis and gathers it over another). A group whose weights are among the outputs
    stays."""
    outputs = {output.var for output in program.outputs}
    gathered = {v for group in program.gathers for v in group.vars}
    graph = {node.name: node for node in typed.bound.exported.graph.nodes}
    last_read: dict[str, int] = {}
    kept: set[str] = set()  # variables some op keeps for backward
    # parameters some op keeps (itself or through a view): what each op saves, probed once on meta tensors
    kept_parameters = typed.bound.parameters_kept_for_backward
    # a variable that is a gathered weight under another name (its gradient's all-reduce, an identity
    # forward; a view of it): its reads are the weight's (GPT-2's tied head reads the embedding's so)
    alias: dict[str, str] = {}
    for index, statement in enumerate(program.statements):
        instruction = statement.instruction
        node = graph.get(statement.node)
        for position, arg in enumerate(instruction.args):
            for name in _names(arg):
                root = alias.get(name, name)
                last_read[name] = last_read[root] = index
                if root in gathered and (instruction.kind != "compute" or not isinstance(arg, Var) or node is None
                                         or _keeps(node, position, kept_parameters)):
                    kept.add(root)
        for _, arg in instruction.kwargs:
            for name in _names(arg):
                root = alias.get(name, name)
                last_read[name] = last_read[root] = index
                if root in gathered:
                    kept.add(root)
        first = instruction.args[0] if instruction.args else None
        if isinstance(first, Var) and alias.get(first.name, first.name) in gathered and (
                instruction.kind == "grad_sync" or (instruction.kind == "compute" and node is not None and is_view(node))):
            alias.update((target, alias.get(first.name, first.name)) for target in statement.targets)
    mesh = program.mesh
    batch_axes = {mesh.axis_names[a] for slot in program.inputs for a, p in enumerate(slot.layout.placements)
                  if p.is_split and p.dim == 0}
    whole = {target for statement in program.statements if statement.instruction.kind == "param_gather"
             for target, layout in zip(statement.targets, statement.layouts) if all(p == B for p in layout.placements)}
    releases: dict[int, list[Statement]] = {}
    groups = list(program.gathers)
    for number, group in enumerate(groups[:-1]):
        read = [last_read[v] for v in group.vars if v in last_read]
        fsdp = any_axis or (group.axis in batch_axes and all(v in whole for v in group.vars))
        if not read or not fsdp or outputs & set(group.vars):
            continue
        regathered = bool(kept & set(group.vars))
        why = "gathered again for backward" if regathered else "backward does not read them"
        releases.setdefault(max(read), []).append(Statement(
            "", Instruction("release", "del", tuple(Var(v) for v in group.vars)),
            f"group {number} used: released (resharded after forward); {why}"))
        regather = Collective("all_gather", group.axis, "backward", group.collective.bytes, f"group {number}",
                              f"{len(group.members)} parameter(s) of {group.members[0].unit or 'outside the layers'}, "
                              "gathered again for backward") if regathered else None
        groups[number] = dataclasses.replace(group, resharded=True, regather=regather, last_read=max(read))
    if not releases:
        return program
    statements = []
    for index, statement in enumerate(program.statements):
        statements.append(statement)
        statements.extend(releases.get(index, ()))
    return dataclasses.replace(program, statements=statements, gathers=groups)


def _names(arg) -> list[str]:
    return Instruction("", "", (arg,)).reads()


def _keeps(node: torch.fx.Node, position: int, kept_parameters: frozenset[str]) -> bool:
    """Whether the value the op reads at argument `position` is a parameter some op keeps for backward;
    where that argument is not one graph value, it is taken to be kept."""
    arg = node.args[position] if position < len(node.args) else None
    return not isinstance(arg, torch.fx.Node) or arg.name in kept_parameters
