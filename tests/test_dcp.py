"""torch.distributed.checkpoint folders both ways: a LLaMA trained by FSDP2 with DTensor tensor parallelism
and saved with DCP resumes under pardsl plans (dp 2 × tp 2, and a 2-stage pipeline) with the losses the
torch run goes on to have; a pardsl run saved with `format="dcp"` resumes under FSDP2 alike. And the
safety of reading such a folder: refused, naming the problem, where it is writable by others, damaged,
incomplete or cut short."""

import functools
import hashlib
import json
import os
import pickle
import re
import warnings

import pytest
import torch

from tests.launch import REPO
from tests.scripts import fsdp2_llama

PP2 = os.path.join(REPO, "examples", "hf_llama_pp2.par")  # HFLlama(layers=2), [8, 16] batches
GPT_DP2_TP2 = os.path.join(REPO, "examples", "gpt_dp2_tp2.par")  # fused q/k/v: S(0, blocks=3) @ tp
GPT_TP4 = os.path.join(REPO, "examples", "gpt_tp4.par")
MLP = os.path.join(REPO, "examples", "mlp.par")  # tp 2: fc1 split by rows, fc2 by columns

# examples/hf_llama_loss_dp2_tp2.par at the torch run's batch (its file takes half of it)
with open(os.path.join(REPO, "examples", "hf_llama_loss_dp2_tp2.par")) as _file:
    DP2_TP2 = _file.read().replace("int64[4, 16]", "int64[8, 16]")
assert DP2_TP2.count("int64[8, 16]") == 2

BEFORE, AFTER = 2, 2  # steps before the save, and after it


def _close(ours: list[float], theirs: list[float]) -> bool:
    return len(ours) == len(theirs) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, theirs))


def _pardsl_run(par: str, load: str | None, save: str | None, skip: int, steps: int, save_after: int = 0) -> list:
    """A pardsl run of `par` on the torch run's batches from the `skip`-th: loaded from `load` (model and
    AdamW), saved to `save` as DCP after `save_after` steps; this rank's losses (none on a pipeline's
    first stage)."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(par)
    model = plan.module(checkpoint=load)
    optimizer = torch.optim.AdamW(model.parameters(), lr=fsdp2_llama.LR)
    if load is not None:
        pardsl.load_optimizer_state(optimizer, model, load)
    losses = []
    for step, batch in enumerate(fsdp2_llama.batches(skip + steps, seed=1)[skip:]):
        if save is not None and step == save_after:
            pardsl.save(model, save, optimizer=optimizer, format="dcp")
        inputs = plan.shard_inputs(input_ids=batch, labels=batch)
        if getattr(model, "pipeline", None) is not None:
            loss = model.step(**inputs)
        else:
            loss = model(**inputs)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    return losses


@pytest.mark.timeout(240)
def test_fsdp2_checkpoint_resumes_under_pardsl_plans_and_back(pools, tmp_path):
    torch_folder, pardsl_folder = str(tmp_path / "fsdp2"), str(tmp_path / "pardsl")
    par = tmp_path / "hf_llama_dp2_tp2.par"
    par.write_text(DP2_TP2)
    four = pools(4)
    torch_run = four.run_on_every_rank(functools.partial(fsdp2_llama.train_save_continue, torch_folder,
                                                         BEFORE, AFTER))[0]
    # FSDP2 + TP → pardsl dp 2 × tp 2: the losses the torch run went on to have
    for losses in four.run_on_every_rank(functools.partial(_pardsl_run, str(par), torch_folder, None,
                                                           BEFORE, AFTER)):
        assert _close(losses, torch_run["after"]), (losses, torch_run)
    # FSDP2 + TP → a 2-stage pipeline: its last stage's losses
    pipelined = [losses for losses in pools(2).run_on_every_rank(
        functools.partial(_pardsl_run, PP2, torch_folder, None, BEFORE, AFTER)) if losses]
    assert len(pipelined) == 1 and _close(pipelined[0], torch_run["after"]), (pipelined, torch_run)
    # pardsl dp 2 × tp 2, from its own start, saved as DCP → FSDP2 + TP goes on as pardsl does
    ours = four.run_on_every_rank(functools.partial(_pardsl_run, str(par), None, pardsl_folder, 0,
                                                    BEFORE + AFTER, BEFORE))[0]
    assert os.path.isfile(os.path.join(pardsl_folder, ".metadata"))
    theirs = four.run_on_every_rank(functools.partial(fsdp2_llama.load_continue, pardsl_folder, BEFORE, AFTER))[0]
    assert _close(theirs, ours[BEFORE:]), (theirs, ours)


def _wrong_shards(model, serial: dict) -> list[str]:
    """The parameters whose shard on this rank is not its share of the serial value."""
    return sorted(name for name, local, layout in model.named_shards()
                  if not torch.equal(local, model.rt.shard(serial[name], layout)))


def _save_then_load(save_par: str, load_par: str, folder: str, strict: bool = True) -> dict:
    """On every rank: a plan of `save_par` (seed 0) saved as DCP to `folder`; read back by torch's own
    planner into whole plain tensors, and by pardsl into a plan of `load_par` made under another seed, and
    into `pardsl.dtensor_state_dict` of it by torch; what differs from the serial model's values."""
    import torch.distributed.checkpoint as dcp

    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(save_par)
    pardsl.save(plan.module(), folder, format="dcp")
    torch.manual_seed(0)
    serial = dict(plan._full_state())
    whole = {name: torch.empty_like(serial[name]) for name in plan.parameter_layouts}
    dcp.load(whole, checkpoint_id=folder)  # torch's DefaultLoadPlanner, no pardsl code
    result = {"torch_whole": sorted(name for name, value in whole.items() if not torch.equal(value, serial[name]))}
    other = pardsl.load(load_par)
    torch.manual_seed(1)
    loaded = other.module(checkpoint=folder, strict=strict)
    result["pardsl"] = _wrong_shards(loaded, serial)
    if getattr(loaded, "pipeline", None) is None:
        torch.manual_seed(1)
        fresh = other.module()
        dcp.load(pardsl.dtensor_state_dict(fresh), checkpoint_id=folder)
        result["dtensor"] = _wrong_shards(fresh, serial)
    return result


@pytest.mark.timeout(180)
def test_blocked_split_saved_as_chunks_torch_and_other_plans_read(pools, tmp_path):
    # fused q/k/v split in blocks over tp on a 2 × 2 mesh: one chunk per block, read back by torch's own
    # planner and by pardsl under tp 4. dcp.load into pardsl.dtensor_state_dict of the tp 4 plan reads the
    # blocked tensors wrong: torch 2.13's planner takes a _StridedShard's local chunk for a contiguous one
    # (docs/checkpoints.md says to load such models with pardsl)
    blocked = ["h.0.attn.c_attn.bias", "h.0.attn.c_attn.weight", "h.1.attn.c_attn.bias", "h.1.attn.c_attn.weight"]
    for result in pools(4).run_on_every_rank(functools.partial(_save_then_load, GPT_DP2_TP2, GPT_TP4,
                                                               str(tmp_path / "gpt"))):
        assert result == {"torch_whole": [], "pardsl": [], "dtensor": blocked}


PHI3_GQA = ('mesh tp = 2\nmodel examples.hf_models:HFCausalLM(family="Phi3", hidden=64, heads=4, kv_heads=2, '
            'ffn=128, vocab=32064)\ninput input_ids : int64[2, 16] in [0, 32064)\nlayout {{\n'
            '    model.model.layers.*.self_attn.qkv_proj.weight : {}\n}}\n')


@pytest.mark.timeout(180)
def test_unequal_blocks_saved_as_chunks_torch_and_other_plans_read(pools, tmp_path):
    # Phi-3's fused q, k and v under grouped-query attention, split in blocks of their sizes over tp: one
    # chunk per block, read back whole by torch's own planner and by pardsl into a plan that splits the
    # projection plainly
    saved, loaded = tmp_path / "blocks.par", tmp_path / "plain.par"
    saved.write_text(PHI3_GQA.format("S(0, blocks=[2, 1, 1])"))
    loaded.write_text(PHI3_GQA.format("S(0)"))
    for result in pools(2).run_on_every_rank(functools.partial(_save_then_load, str(saved), str(loaded),
                                                               str(tmp_path / "phi3"))):
        assert result == {"torch_whole": [], "pardsl": [], "dtensor": []}


@pytest.mark.timeout(180)
def test_pipeline_with_tied_weights_saved_as_dcp(pools, tmp_path):
    # GPT-2 on a 2-stage pipeline, its embedding and head tied across the stages; loaded under tp 2 with
    # c_attn split in blocks (that plan's model line asks for eager attention: strict=False)
    pipeline = os.path.join(REPO, "examples", "hf_gpt2_pp2.par")
    tensor_parallel = os.path.join(REPO, "examples", "hf_gpt2_tp2.par")
    for result in pools(2).run_on_every_rank(functools.partial(_save_then_load, pipeline, tensor_parallel,
                                                               str(tmp_path / "gpt2"), False)):
        assert result["torch_whole"] == [] and result["pardsl"] == []


def _dtensor_saved_pardsl_loads(par: str, folder: str) -> list[str]:
    """dcp.save of pardsl.dtensor_state_dict, as a user's DTensor tool writes it; pardsl loads it."""
    import torch.distributed.checkpoint as dcp

    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(par)
    dcp.save(pardsl.dtensor_state_dict(plan.module()), checkpoint_id=folder)
    torch.manual_seed(0)
    serial = dict(plan._full_state())
    torch.manual_seed(1)
    return _wrong_shards(plan.module(checkpoint=folder), serial)


@pytest.mark.timeout(120)
def test_dtensor_state_dict_and_pardsl_read_each_others_dcp(pools, tmp_path):
    par = os.path.join(REPO, "examples", "llama_train_dp2_tp2.par")
    for wrong in pools(4).run_on_every_rank(functools.partial(_dtensor_saved_pardsl_loads, par, str(tmp_path / "d"))):
        assert wrong == []
    for result in pools(4).run_on_every_rank(functools.partial(_save_then_load, par, par, str(tmp_path / "p"))):
        assert result == {"torch_whole": [], "pardsl": [], "dtensor": []}


# ---------------------------------------------------------------------------------------------------
# Safety: nothing in a folder another user can write is read, and a damaged folder is refused by name


def _torch_folder(folder) -> str:
    """A DCP folder torch writes in one process (two tensors, a counter and a number)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "b": torch.randn(32), "optimizer": {"state.w.step": torch.tensor(3.0),
                                                                           "param_groups.w.lr": 0.5}}
    with warnings.catch_warnings():  # that it saves in one process, as asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return str(folder)


class _Planted:
    """Unpickled, it would leave a file: proof that a pickle ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_world_writable_folder_refused_before_metadata_is_read(tmp_path):
    from pardsl.runtime.checkpoint import CheckpointError, UntrustedFolderError
    from pardsl.runtime.dcp import DcpSource

    folder = _torch_folder(tmp_path / "shared")
    marker = tmp_path / "ran"
    with open(os.path.join(folder, ".metadata"), "wb") as handle:
        pickle.dump(_Planted(str(marker)), handle)
    os.chmod(folder, 0o777)
    with pytest.raises(UntrustedFolderError, match="writable by others"):
        DcpSource(folder)
    assert not marker.exists()
    # trusted deliberately, the pickle still makes nothing but DCP's own classes
    with pytest.raises(CheckpointError, match="cannot be read.*io.open|cannot be read.*builtins"):
        DcpSource(folder, allow_shared_folder=True)
    assert not marker.exists()


def test_torch_folder_reads_and_its_checks_hold(tmp_path):
    from pardsl.runtime.checkpoint import Region
    from pardsl.runtime.dcp import DcpSource

    source = DcpSource(_torch_folder(tmp_path / "ok"))
    assert source.sidecar is None and sorted(source.tensors) == ["b", "optimizer.state.w.step", "w"]
    target = torch.zeros(32, 32)  # rows 16 to 47 of w
    values = source.read({"w": [(Region((16, 0), (32, 32), (0, 0)), target)]}, ["optimizer.param_groups.w.lr"])
    torch.manual_seed(0)
    w, b = torch.randn(64, 32), torch.randn(32)
    assert torch.equal(target, w[16:48]) and values == {"optimizer.param_groups.w.lr": 0.5}
    # exported whole, as Hugging Face's safetensors, without the optimizer's state
    from safetensors.torch import load_file

    import pardsl

    assert pardsl.export_checkpoint(source.path, str(tmp_path / "model.safetensors")) == ["b", "w"]
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(exported["w"], w) and torch.equal(exported["b"], b)


@pytest.mark.parametrize("damage, message", [
    ("truncate_metadata", "its .metadata cannot be read"),
    ("garbage_metadata", "its .metadata cannot be read"),
    ("missing_shard", "file __0_0.distcp is missing"),
    ("short_shard", "file __0_0.distcp has .* bytes; its chunks end at byte"),
    ("long_shard", "file __0_0.distcp has .* bytes; its chunks end at byte"),
    ("chunk_dropped", "tensor `w`: its pieces hold"),
    ("chunk_outside", "tensor `w`: a chunk is malformed or lies outside"),
    ("offsets_an_int", "tensor `w`: a chunk.s offsets are 0, not 2 non-negative ints"),
    ("sizes_none", "tensor `w`: a chunk's sizes are None, not 2 non-negative ints"),
    ("path_outside", "names a file outside the folder"),
])
def test_damaged_folder_refused_naming_the_problem(tmp_path, damage, message):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from pardsl.runtime.checkpoint import CheckpointError
    from pardsl.runtime.dcp import DcpSource

    folder = _torch_folder(tmp_path / "damaged")
    metadata_path, shard = os.path.join(folder, ".metadata"), os.path.join(folder, "__0_0.distcp")
    with open(metadata_path, "rb") as handle:
        raw = handle.read()
    metadata = pickle.loads(raw)
    if damage == "truncate_metadata":
        raw = raw[:len(raw) // 2]
    elif damage == "garbage_metadata":
        raw = b"\x80\x05not a pickle at all"
    elif damage == "missing_shard":
        os.remove(shard)
    elif damage == "short_shard":
        os.truncate(shard, os.path.getsize(shard) - 10)
    elif damage == "long_shard":
        with open(shard, "ab") as handle:
            handle.write(b"\0" * 10)
    elif damage == "chunk_dropped":
        metadata.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([32, 32]))]
    elif damage == "chunk_outside":
        chunk = metadata.state_dict_metadata["w"].chunks[0]
        chunk.sizes = torch.Size([65, 32])
    elif damage == "offsets_an_int":
        metadata.state_dict_metadata["w"].chunks[0].offsets = 0
    elif damage == "sizes_none":
        metadata.state_dict_metadata["w"].chunks[0].sizes = None
    elif damage == "path_outside":
        for info in metadata.storage_data.values():
            info.relative_path = "../elsewhere.distcp"
    if damage in ("chunk_dropped", "chunk_outside", "offsets_an_int", "sizes_none", "path_outside"):
        raw = pickle.dumps(metadata)
    with open(metadata_path, "wb") as handle:
        handle.write(raw)
    with pytest.raises(CheckpointError, match=message):
        DcpSource(folder)


def _plant_sidecar(folder: str, **fields) -> dict:
    """A pardsl.dcp.json beside a folder torch wrote, right for its files, with `fields` set over it."""
    data = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".distcp")):
        with open(os.path.join(folder, file), "rb") as handle:
            data[file] = handle.read()
    document = {"format": "pardsl-dcp/1", "save_id": "0123456789abcdef", "save_counter": 1, "saved_at": 1.0e9,
                "files": {file: len(content) for file, content in data.items()},
                "sha256": {file: hashlib.sha256(content).hexdigest() for file, content in data.items()},
                "plan": {"path": "mlp.par", "text": "", "model": "examples.models:MLP()", "mesh": {"dp": 2}},
                "optimizer_class": "AdamW", "metadata": None, **fields}
    with open(os.path.join(folder, "pardsl.dcp.json"), "w") as handle:
        json.dump(document, handle)
    return document


@pytest.mark.parametrize("fields, message", [
    ({}, None),
    ({"plan": "examples.models:MLP()"}, "`plan` is not an object"),
    ({"plan": {"path": None, "text": "", "model": 3, "mesh": {}}}, "`plan` is not an object"),
    ({"optimizer_class": ["AdamW"]}, "`optimizer_class` is ['AdamW'], not a string"),
    ({"save_id": 7}, "`save_id` is 7, not a string"),
    ({"save_counter": "9"}, "`save_counter` is '9', not a count"),
    ({"saved_at": "yesterday"}, "`saved_at` is 'yesterday', not a time"),
    ({"files": {"__0_0.distcp": "12"}}, "`files` is not an object of file names and sizes"),
    ({"sha256": {"__0_0.distcp": 12}}, "`sha256` does not give one hash"),
    ({"format": "pardsl-dcp/0"}, "its format is 'pardsl-dcp/0'"),
])
def test_sidecar_of_the_wrong_shape_refused(tmp_path, fields, message):
    # each field is used as the type save writes (plan["model"], optimizer_class in messages and checks):
    # one of another type is refused when the folder is opened, not an AttributeError later
    from pardsl.runtime.checkpoint import CheckpointError
    from pardsl.runtime.dcp import DcpSource

    folder = _torch_folder(tmp_path / "sidecar")
    _plant_sidecar(folder, **fields)
    if message is None:
        assert DcpSource(folder).sidecar["optimizer_class"] == "AdamW"
        return
    with pytest.raises(CheckpointError, match=f"pardsl.dcp.json is malformed: {re.escape(message)}"):
        DcpSource(folder)


def test_metadata_changed_since_the_save_refused_before_it_is_unpickled(tmp_path):
    from pardsl.runtime.checkpoint import CheckpointError
    from pardsl.runtime.dcp import DcpSource

    folder = _torch_folder(tmp_path / "metadata")
    where = os.path.join(folder, ".metadata")
    with open(where, "rb") as handle:
        raw = handle.read()
    _plant_sidecar(folder, metadata_sha256=hashlib.sha256(raw).hexdigest())
    assert sorted(DcpSource(folder).tensors) == ["b", "optimizer.state.w.step", "w"]
    other = pickle.dumps(pickle.loads(raw), protocol=2)  # the same metadata in other bytes
    assert other != raw
    with open(where, "wb") as handle:
        handle.write(other)
    with pytest.raises(CheckpointError, match="its .metadata does not hold the bytes saved: its sha256 is"):
        DcpSource(folder)
    assert sorted(DcpSource(folder, verify=False).tensors) == ["b", "optimizer.state.w.step", "w"]


def _save_with_rank_0_failing(folder: str) -> str:
    """A DCP save of mlp.par's model in which rank 0 fails once the data files are written (its disk full
    as it writes the sidecar): what each rank's pardsl.save raised."""
    import pardsl
    from pardsl.runtime import dcp

    torch.manual_seed(0)
    model = pardsl.load(MLP).module()
    original = dcp._new_temporary

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if torch.distributed.get_rank() == 0:
        dcp._new_temporary = disk_full
    try:
        pardsl.save(model, folder, format="dcp")
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(error).__name__}: {error}"
    finally:
        dcp._new_temporary = original
    return "saved"


@pytest.mark.timeout(120)
def test_a_save_rank_0_fails_to_finish_fails_on_every_rank(pools, tmp_path):
    # rank 0 alone writes the sidecar and renames the folder into place: had the others gone on to the
    # barrier, they would wait there until the process group's timeout
    folder = str(tmp_path / "mlp")
    for error in pools(2).run_on_every_rank(functools.partial(_save_with_rank_0_failing, folder)):
        assert error.startswith(f"CheckpointError: saving to {folder} failed on rank 0") \
            and "No space left on device" in error, error
    assert not os.path.exists(folder)


def _save_and_load_mlp(folder: str, step: str, par: str = os.path.join(REPO, "examples", "mlp.par")) -> str | None:
    """`dcp`, `pardsl`: pardsl.save of `par` in that format; `load`: the CheckpointError loading it raises."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(par)
    if step in ("dcp", "pardsl"):
        pardsl.save(plan.module(), folder, format=step, metadata={"step": 7})
        return None
    try:
        plan.module(checkpoint=folder)
    except pardsl.CheckpointError as error:
        return str(error)
    return None


@pytest.mark.timeout(120)
def test_pardsl_dcp_save_hashes_its_files_and_refuses_a_shared_folder(pools, tmp_path):
    import pardsl

    folder = tmp_path / "mlp"
    pool = pools(2)
    pool.run_on_every_rank(functools.partial(_save_and_load_mlp, str(folder), "dcp"))
    assert pardsl.checkpoint_metadata(str(folder)) == {"step": 7}
    with open(folder / "pardsl.dcp.json") as handle, open(folder / ".metadata", "rb") as metadata:
        assert json.load(handle)["metadata_sha256"] == hashlib.sha256(metadata.read()).hexdigest()
    assert pool.run_on_every_rank(functools.partial(_save_and_load_mlp, str(folder), "load")) == [None, None]
    shard = next(folder.glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    # each rank hashes the files it reads from: rank 1 reads its half of fc1 and fc2 from its own file
    errors = pool.run_on_every_rank(functools.partial(_save_and_load_mlp, str(folder), "load"))
    assert errors[1] is not None and f"file {shard.name} does not hold the bytes saved" in errors[1]
    # latest_checkpoint weighs both formats' saves by their counters
    for later, format in (("own", "pardsl"), ("dcp_again", "dcp")):
        pool.run_on_every_rank(functools.partial(_save_and_load_mlp, str(tmp_path / later), format))
        assert pardsl.latest_checkpoint(str(tmp_path)) == str(tmp_path / later)
    # ... by their counters, not their times: these saves are later by both; one of a higher counter and
    # an older saved_at (a clock set back since) is the latest
    planted = _torch_folder(tmp_path / "counted")
    _plant_sidecar(planted, save_counter=100, saved_at=1.0e9)
    assert pardsl.latest_checkpoint(str(tmp_path)) == planted
    # another model's plan is refused, naming both models
    error = pool.run_on_every_rank(functools.partial(_save_and_load_mlp, str(tmp_path / "dcp_again"), "load",
                                                     os.path.join(REPO, "examples", "gpt_tp2.par")))[0]
    assert "was saved from model `examples.models:MLP" in error and "To load it anyway" in error
    # a DCP save replaces a DCP folder as a whole, never a folder holding anything else
    with pytest.raises(Exception, match="refusing to save to .*: it holds .*no part of a DCP checkpoint"):
        pool.run_on_every_rank(functools.partial(_save_and_load_mlp, str(tmp_path), "dcp"))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(Exception, match="refusing to save to .*writable by others"):
        pool.run_on_every_rank(functools.partial(_save_and_load_mlp, str(shared / "mlp"), "dcp"))


def _load_wrapped_llama(folder: str, strict: bool):
    """hf_llama_tp2.par's model (LlamaForCausalLM under `model`) loaded from `folder`: the parameters whose
    shard differs from the folder's tensor under the name without the wrapper's `model.`; or the
    CheckpointError."""
    import pardsl
    from pardsl.runtime.dcp import whole_model_tensors

    torch.manual_seed(1)
    try:
        model = pardsl.load(os.path.join(REPO, "examples", "hf_llama_tp2.par")).module(checkpoint=folder,
                                                                                       strict=strict)
    except pardsl.CheckpointError as error:
        return str(error)
    return _wrong_shards(model, {"model." + name: value for name, value in whole_model_tensors(folder).items()})


@pytest.mark.timeout(120)
def test_strict_false_matches_names_without_a_wrappers_module_as_the_own_format_does(pools, tmp_path):
    # a folder of the plain Hugging Face model (`model.layers...`, `lm_head.weight`), as a torch run of
    # LlamaForCausalLM saves it, loaded into a plan whose model wraps it (`model.model.layers...`)
    import torch.distributed.checkpoint as dcp

    import examples.hf_models

    folder = str(tmp_path / "plain")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(examples.hf_models.HFLlama(layers=2).model.state_dict(), checkpoint_id=folder, no_dist=True)
    pool = pools(2)
    assert pool.run_on_every_rank(functools.partial(_load_wrapped_llama, folder, False)) == [[], []]
    for error in pool.run_on_every_rank(functools.partial(_load_wrapped_llama, folder, True)):
        assert "holds tensor(s) this model does not have: lm_head.weight" in error, error


def _mlp_torch_folder(folder: str, extra: dict) -> str:
    """A DCP folder torch writes of mlp.par's model and an AdamW state, with `extra` entries set over it."""
    import torch.distributed.checkpoint as dcp

    import pardsl

    torch.manual_seed(0)
    model = dict(pardsl.load(MLP)._full_state())
    optimizer = {}
    for name, value in model.items():
        optimizer.update({f"state.{name}.exp_avg": torch.zeros_like(value), f"state.{name}.step": torch.tensor(3.0),
                          f"state.{name}.exp_avg_sq": torch.zeros_like(value), f"param_groups.{name}.lr": 0.5})
    state = {**model, "optimizer": optimizer}
    for key, value in extra.items():
        if key.startswith("optimizer."):
            optimizer[key[len("optimizer."):]] = value
        else:
            state[key] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder


def _load_mlp_optimizer(folder: str, strict: bool) -> str | None:
    """The CheckpointError loading `folder`'s optimizer state into mlp.par's AdamW raises; None if it loads."""
    import pardsl

    plan = pardsl.load(MLP)
    model = plan.module()
    optimizer = torch.optim.AdamW(model.parameters())
    try:
        pardsl.load_optimizer_state(optimizer, model, folder, strict=strict)
    except pardsl.CheckpointError as error:
        return str(error)
    assert optimizer.param_groups[0]["lr"] == 0.5
    return None


@pytest.mark.timeout(120)
def test_optimizer_state_of_another_shape_or_model_refused(pools, tmp_path):
    pool = pools(2)
    ok = _mlp_torch_folder(str(tmp_path / "ok"), {})
    assert pool.run_on_every_rank(functools.partial(_load_mlp_optimizer, ok, True)) == [None, None]
    # a moment of another shape than its parameter's is neither read whole onto every rank nor loaded
    wrong = _mlp_torch_folder(str(tmp_path / "shape"), {"optimizer.state.fc1.weight.exp_avg": torch.zeros(2, 3)})
    for strict in (True, False):
        for error in pool.run_on_every_rank(functools.partial(_load_mlp_optimizer, wrong, strict)):
            assert "optimizer state `exp_avg` of parameter fc1.weight has shape [2, 3]; the parameter's is " \
                "[1024, 256]" in error, error
    # strict: the folder must be of this model, as for the own format; strict=False loads it regardless
    foreign = _mlp_torch_folder(str(tmp_path / "foreign"), {"fc3.weight": torch.zeros(4, 4)})
    for error in pool.run_on_every_rank(functools.partial(_load_mlp_optimizer, foreign, True)):
        assert "holds tensor(s) this model does not have: fc3.weight" in error, error
    assert pool.run_on_every_rank(functools.partial(_load_mlp_optimizer, foreign, False)) == [None, None]


def test_hyperparameters_flattened_or_as_one_list():
    from pardsl.runtime.checkpoint import CheckpointError
    from pardsl.runtime.dcp import _saved_hyperparameters

    flattened = {"optimizer.param_groups.w.lr": 0.5, "optimizer.param_groups.w.betas": (0.9, 0.95),
                 "optimizer.param_groups.b.lr": 0.1}
    assert _saved_hyperparameters(flattened, "optimizer.param_groups", ["w", "b"], "c") == \
        {"lr": 0.5, "betas": (0.9, 0.95)}
    listed = {"optim.param_groups": [{"lr": 0.1, "params": ["b"]}, {"lr": 0.5, "params": ["w"]}]}
    assert _saved_hyperparameters(listed, "optim.param_groups", ["w"], "c") == {"lr": 0.5}
    with pytest.raises(CheckpointError, match="no saved parameter group holds x"):
        _saved_hyperparameters(listed, "optim.param_groups", ["x"], "c")


def test_stored_values_never_unpickled_beyond_weights_only(tmp_path):
    # a value a torch folder stores as bytes is a pickle too: DCP's own planner would run this one
    import torch.distributed.checkpoint as dcp

    from pardsl.runtime.checkpoint import CheckpointError
    from pardsl.runtime.dcp import DcpSource

    marker = tmp_path / "ran"
    folder = str(tmp_path / "planted")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(4), "optimizer": {"param_groups.w.lr": _Planted(str(marker))}},
                 checkpoint_id=folder, no_dist=True)
    with pytest.raises(CheckpointError, match="a chunk cannot be read"):
        DcpSource(folder).read({}, ["optimizer.param_groups.w.lr"])
    assert not marker.exists()


def test_garbled_chunk_refused_without_a_traceback(tmp_path):
    from pardsl.runtime.checkpoint import CheckpointError, Region
    from pardsl.runtime.dcp import DcpSource

    folder = _torch_folder(tmp_path / "garbled")
    source = DcpSource(folder)
    info = source.metadata.storage_data[next(i for i in source.metadata.storage_data if i.fqn == "w")]
    with open(os.path.join(folder, info.relative_path), "r+b") as handle:  # the record's zip header
        handle.seek(info.offset)
        handle.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match="a chunk cannot be read"):
        DcpSource(folder).read({"w": [(Region((0, 0), (64, 32), (0, 0)), torch.empty(64, 32))]})
