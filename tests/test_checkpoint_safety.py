"""Checkpoints are all or nothing: a save that dies part-way leaves the previous one loadable; a loader
checks the whole index (files, save ids, sizes, pieces and their coverage) and the model before it reads a
byte, and refuses a damaged, mixed or foreign checkpoint with an error saying what is wrong."""

import copy
import datetime
import functools
import json
import multiprocessing
import os
import shutil

import pytest
import torch

from pardsl.runtime.checkpoint import INDEX_FILE, CheckpointError, CheckpointSource, latest_checkpoint
from tests.launch import REPO

MLP_TP2 = os.path.join(REPO, "examples/mlp.par")


def _train_and_save(par: str, folder: str, scale: float = 1.0) -> str:
    """On every rank: a step of AdamW on the MLP, then a checkpoint of model and optimizer."""
    import pardsl

    torch.manual_seed(0)
    plan = pardsl.load(par)
    model = plan.module()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(scale)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    model(**plan.shard_inputs(x=x)).sum().backward()
    optimizer.step()
    pardsl.save(model, folder, optimizer=optimizer, metadata={"step": 1})
    return CheckpointSource(folder).document["save_id"]


def _load(par: str, folder: str, strict: bool = True, optimizer: str = "AdamW", **options):
    """On every rank: the model from `folder` under plan `par`, and its optimizer state; or the error.
    `options`: verify=, allow_shared_folder=, given to both loads."""
    import pardsl

    plan = pardsl.load(par)
    try:
        model = plan.module(checkpoint=folder, strict=strict, **options)
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-2)
        pardsl.load_optimizer_state(opt, model, folder, strict=strict, **options)
    except (CheckpointError, KeyError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return {name: local.detach().clone() for name, local, _ in model.named_shards()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, request):
    pools = request.getfixturevalue("pools")
    folder = str(tmp_path_factory.mktemp("ckpt") / "step-1")
    pools(2).run_on_every_rank(functools.partial(_train_and_save, MLP_TP2, folder))
    return folder


def _damaged(saved: str, tmp_path, damage) -> str:
    folder = str(tmp_path / "damaged")
    shutil.copytree(saved, folder)
    index = json.load(open(os.path.join(folder, INDEX_FILE)))
    damage(index, folder)
    with open(os.path.join(folder, INDEX_FILE), "w") as handle:
        json.dump(index, handle)
    return folder


def _split_tensor(index) -> dict:
    return index["tensors"]["fc1.weight"]  # S(0) over tp 2: two pieces, one in each rank's file


def _drop_piece(index, folder):
    _split_tensor(index)["pieces"].pop()


def _negative_size(index, folder):
    _split_tensor(index)["pieces"][0]["sizes"][0] = -512


def _shift_offset(index, folder):
    _split_tensor(index)["pieces"][0]["offsets"][0] += 1


def _larger_than_stored(index, folder):
    _split_tensor(index)["pieces"][0]["sizes"][1] = 512  # [512, 256] stored; inside the tensor's [1024, 256]
    _split_tensor(index)["shape"][1] = 512


def _outside_the_folder(index, folder):
    name = sorted(index["files"])[0]
    shutil.copy(os.path.join(folder, name), os.path.join(os.path.dirname(folder), "elsewhere.safetensors"))
    index["files"]["../elsewhere.safetensors"] = index["files"].pop(name)
    for entry in index["tensors"].values():
        for piece in entry["pieces"]:
            if piece["file"] == name:
                piece["file"] = "../elsewhere.safetensors"


def _cut_short(index, folder):
    name = sorted(index["files"])[1]
    with open(os.path.join(folder, name), "r+b") as handle:
        handle.truncate(os.path.getsize(os.path.join(folder, name)) - 100)


def _missing_file(index, folder):
    os.remove(os.path.join(folder, sorted(index["files"])[1]))


def _not_json(index, folder):
    index.clear()
    index["format"] = "pardsl-checkpoint/1"


@pytest.mark.parametrize("damage, message", [
    (_drop_piece, "tensor `fc1.weight`: its pieces hold 131072 elements; the tensor has 262144"),
    (_negative_size, "tensor `fc1.weight`: a piece is malformed"),
    (_shift_offset, "tensor `fc1.weight`: its pieces overlap and leave elements uncovered"),
    (_larger_than_stored, "is stored as F32 [512, 256]; the index says F32 [512, 512]"),
    (_outside_the_folder, "its index names a file outside the folder: '../elsewhere.safetensors'"),
    (_cut_short, "bytes; the index says"),
    (_missing_file, "is missing (a save that did not finish, or a file removed)"),
    (_not_json, "this pardsl reads 'pardsl-checkpoint/2'"),
], ids=["dropped-piece", "negative-size", "shifted-offset", "larger-than-stored", "outside-the-folder",
        "cut-short", "missing-file", "old-format"])
def test_a_damaged_checkpoint_is_refused_before_anything_is_read(saved, tmp_path, damage, message):
    folder = _damaged(saved, tmp_path, damage)
    with pytest.raises(CheckpointError, match="the checkpoint is refused") as refused:
        CheckpointSource(folder)
    assert message in str(refused.value)
    assert latest_checkpoint(str(tmp_path)) is None  # passed over as incomplete


def test_files_of_two_saves_mixed_are_refused(saved, tmp_path, pools):
    """An overwrite that stopped after some ranks replaced their files, as it could before: one file of
    another save in the place of this save's file (the same size), under this save's index."""
    other = str(tmp_path / "other")
    pools(2).run_on_every_rank(functools.partial(_train_and_save, MLP_TP2, other, 100.0))
    folder = str(tmp_path / "mixed")
    shutil.copytree(saved, folder)
    mine = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    theirs = sorted(f for f in os.listdir(other) if f.endswith(".safetensors"))[0]
    shutil.copy(os.path.join(other, theirs), os.path.join(folder, mine))
    with pytest.raises(CheckpointError, match=r"belongs to save .*, not to this index.s save .* \(files of two saves mixed\)"):
        CheckpointSource(folder)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_unless_asked(saved, tmp_path, pools):
    # the same MLP under another plan (dp 2) loads it: any plan of the model does
    loaded = pools(2).run_on_every_rank(functools.partial(_load, os.path.join(REPO, "examples/mlp_dp.par"), saved))
    assert all(isinstance(rank, dict) for rank in loaded), loaded
    # another model line
    other_model = tmp_path / "other_model.par"
    other_model.write_text(open(MLP_TP2).read().replace("MLP(d_model=256, d_ff=1024)", "MLP(d_ff=1024, d_model=256)"))
    refused = pools(2).run_on_every_rank(functools.partial(_load, str(other_model), saved))
    assert refused[0] == (f"CheckpointError: {saved} was saved from model `examples.models:MLP(d_model=256, "
                          "d_ff=1024)`; this plan builds `examples.models:MLP(d_ff=1024, d_model=256)`. To load it "
                          "anyway (a deliberate transfer), pass strict=False")
    transferred = pools(2).run_on_every_rank(functools.partial(_load, str(other_model), saved, False))
    for got, expected in zip(transferred, pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, saved))):
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    # another optimizer class
    refused = pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, saved, True, "SGD"))
    assert "holds the state of a AdamW optimizer; this one is a SGD" in refused[0]


def _renamed(index, folder):
    """fc2.weight's entry under the name `weight`: the suffix rule would give it to any `*.weight` of its
    shape, such as fc2.weight itself, wherever the exact name is missing."""
    index["tensors"]["weight"] = index["tensors"].pop("fc2.weight")


def test_a_tensor_under_a_name_the_model_lacks_is_not_matched_by_its_suffix(saved, tmp_path, pools):
    folder = _damaged(saved, tmp_path, _renamed)
    refused = pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, folder))
    assert refused[0].startswith(f"CheckpointError: {folder} holds tensor(s) this model does not have: weight")


def _save_twice_and_die(rank: int, port: int, folder: str, results) -> None:
    """Save into `folder`, then save other values into it again; rank 1 dies as soon as its new file is
    written, before the index could be."""
    import torch.distributed as dist

    import pardsl
    from pardsl.runtime import checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=5))
    torch.manual_seed(0)
    plan = pardsl.load(MLP_TP2)
    model = plan.module()
    pardsl.save(model, folder, metadata={"step": 1})
    first = {name: local.detach().tolist() for name, local, _ in model.named_shards()}  # the queue takes lists
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    if rank == 1:
        original = checkpoint.save_file

        def save_then_die(*args, **kwargs):
            original(*args, **kwargs)
            os._exit(9)

        checkpoint.save_file = save_then_die
    try:
        pardsl.save(model, folder, metadata={"step": 2})
        results.put((rank, "saved", None))
    except Exception as error:  # rank 0: its peer is gone in the middle of the save
        results.put((rank, type(error).__name__, first))


def test_a_save_killed_between_ranks_leaves_the_previous_checkpoint_loadable(tmp_path, pools):
    from pardsl.runtime.devices import free_port

    folder = str(tmp_path / "ckpt")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_save_twice_and_die, args=(rank, port, folder, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        rank, outcome, first = results.get(timeout=120)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert rank == 0 and outcome != "saved"
    assert processes[1].exitcode == 9
    source = CheckpointSource(folder)  # the first save, whole, beside the second's orphaned files
    assert source.document["metadata"] == {"step": 1}
    # beside it: rank 0's new file, and rank 1's, written but never renamed into place
    assert sorted(f.rsplit(".", 2)[-1] if f.endswith(".tmp") else "safetensors" for f in os.listdir(folder)
                  if f != INDEX_FILE) == ["safetensors"] * 3 + ["tmp"]
    assert latest_checkpoint(str(tmp_path)) == folder
    loaded = pools(2).run_on_every_rank(functools.partial(_load_model_only, MLP_TP2, folder))
    assert all(torch.equal(loaded[0][name], torch.tensor(first[name])) for name in first)


def _load_model_only(par: str, folder: str) -> dict:
    import pardsl

    model = pardsl.load(par).module(checkpoint=folder)
    return {name: local.detach().clone() for name, local, _ in model.named_shards()}


def test_the_latest_complete_checkpoint_is_the_newest_published(saved, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for step in (1, 2, 3):
        shutil.copytree(saved, runs / f"step-{step}")
        index = json.load(open(runs / f"step-{step}" / INDEX_FILE))
        index["saved_at"] = 1000.0 + step
        (runs / f"step-{step}" / INDEX_FILE).write_text(json.dumps(index))
    os.remove(runs / "step-3" / sorted(json.load(open(runs / "step-3" / INDEX_FILE))["files"])[0])
    (runs / "step-4").mkdir()  # a save into a new folder that died before its index
    assert latest_checkpoint(str(runs)) == str(runs / "step-2")
    assert latest_checkpoint(str(tmp_path / "nothing-here")) is None
    assert copy.deepcopy(CheckpointSource(str(runs / "step-2")).document["metadata"]) == {"step": 1}


def _save_with_save_id(par: str, folder: str, save_id: str) -> str:
    """On every rank: `_train_and_save` with the save's id known beforehand (as another user watching the
    folder could learn it), so that the names the save's temporary files had can be planted."""
    import secrets

    original = secrets.token_hex
    secrets.token_hex = lambda nbytes=None: save_id
    try:
        return _train_and_save(par, folder)
    finally:
        secrets.token_hex = original


def test_a_save_writes_through_no_symlink_planted_at_a_temporary_name(tmp_path, pools):
    folder, outside = tmp_path / "ckpt", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    save_id = "ab" * 8
    planted = ["pardsl.index.json.tmp"] + [f"rank-{rank:05d}-of-00002.{save_id}.safetensors.tmp" for rank in (0, 1)]
    for name in planted:
        (outside / name).write_text("precious")
        os.symlink(outside / name, folder / name)
    pools(2).run_on_every_rank(functools.partial(_save_with_save_id, MLP_TP2, str(folder), save_id))
    assert sorted(os.listdir(outside)) == sorted(planted)
    assert all((outside / name).read_text() == "precious" for name in planted)
    assert CheckpointSource(str(folder)).document["metadata"] == {"step": 1}


def _save_or_refusal(par: str, folder: str, **options) -> str:
    import pardsl

    try:
        pardsl.save(pardsl.load(par).module(), folder, **options)
    except CheckpointError as error:
        return str(error)
    return "saved"


def test_a_folder_others_can_write_is_refused_unless_allowed(saved, tmp_path, pools):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone may replace its entries: no sticky bit
    refused = pools(2).run_on_every_rank(functools.partial(_save_or_refusal, MLP_TP2, str(shared / "ckpt")))
    assert refused[0] == refused[1] and refused[0].startswith(f"refusing to save to {shared / 'ckpt'}: {shared} is "
                                                              "writable by others without the sticky bit")
    assert "pass allow_shared_folder=True" in refused[0] and not os.path.exists(shared / "ckpt")
    shutil.copytree(saved, shared / "copy")
    with pytest.raises(CheckpointError, match=f"{shared} is writable by others without the sticky bit"):
        CheckpointSource(str(shared / "copy"))
    loaded = pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, str(shared / "copy")))
    assert "pass allow_shared_folder=True" in loaded[0]
    # the override, on save and on load
    assert pools(2).run_on_every_rank(functools.partial(_save_or_refusal, MLP_TP2, str(shared / "ckpt"),
                                                        allow_shared_folder=True)) == ["saved", "saved"]
    loaded = pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, str(shared / "copy"),
                                                          allow_shared_folder=True))
    assert all(isinstance(rank, dict) for rank in loaded), loaded
    # the sticky bit (as /tmp has it) keeps others from replacing what they do not own
    os.chmod(shared, 0o1777)
    assert CheckpointSource(str(shared / "copy")).document["metadata"] == {"step": 1}


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user takes root")
def test_a_folder_another_user_owns_is_refused(saved, tmp_path):
    theirs = tmp_path / "theirs"
    shutil.copytree(saved, theirs)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(CheckpointError, match=f"{theirs}: {theirs} is owned by uid 65534, not by you"):
        CheckpointSource(str(theirs))
    assert CheckpointSource(str(theirs), allow_shared_folder=True).document["metadata"] == {"step": 1}


@pytest.mark.parametrize("step, saved_at", [(1, float("nan")), (1, 1e300), (1, float("inf")), (2, -1.0), (2, True)])
def test_the_latest_checkpoint_is_the_last_saved_whatever_time_its_index_gives(step, saved_at, tmp_path, pools):
    runs = tmp_path / "runs"
    for saved in (1, 2):
        pools(2).run_on_every_rank(functools.partial(_train_and_save, MLP_TP2, str(runs / f"step-{saved}")))
    index = json.load(open(runs / f"step-{step}" / INDEX_FILE))
    index["saved_at"] = saved_at  # a time no save has: the older save's, after the newer; the newer's, before
    (runs / f"step-{step}" / INDEX_FILE).write_text(json.dumps(index))
    assert latest_checkpoint(str(runs)) == str(runs / "step-2")
    counters = [json.load(open(runs / f"step-{step}" / INDEX_FILE))["save_counter"] for step in (1, 2)]
    assert counters[1] == counters[0] + 1


def _overwrite_inside_a_weight(folder: str) -> str:
    """4 KiB of a data file's tensor bytes replaced; its size, header and save id kept."""
    name = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[1]
    file = os.path.join(folder, name)
    with open(file, "r+b") as handle:
        handle.seek(os.path.getsize(file) // 2)
        handle.write(bytes(range(256)) * 16)
    return name


def test_changed_tensor_bytes_are_refused_unless_verification_is_off(saved, tmp_path, pools):
    folder = str(tmp_path / "changed")
    shutil.copytree(saved, folder)
    name = _overwrite_inside_a_weight(folder)
    refused = pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, folder))
    assert any(f"file {name} does not hold the bytes saved: its sha256 is" in rank for rank in refused
               if isinstance(rank, str)), refused
    unverified = pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, folder, verify=False))
    assert all(isinstance(rank, dict) for rank in unverified), unverified


def test_a_checkpoint_without_content_hashes_loads_only_unverified(saved, tmp_path, pools):
    folder = _damaged(saved, tmp_path, lambda index, folder: index.pop("sha256", None))
    with pytest.raises(CheckpointError, match="gives no sha256 for file .* To load it unverified, pass verify=False"):
        CheckpointSource(folder)
    assert all(isinstance(rank, dict) for rank in
               pools(2).run_on_every_rank(functools.partial(_load, MLP_TP2, folder, verify=False)))


def _hf_folder(tmp_path, file: str):
    """A Hugging Face folder whose index names `file` for tensor `w`; a safetensors file outside it."""
    from safetensors.torch import save_file

    hf, outside = tmp_path / "hf", tmp_path / "outside"
    hf.mkdir()
    outside.mkdir()
    save_file({"w": torch.ones(2)}, str(outside / "x.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": file}}))
    return hf, outside


@pytest.mark.parametrize("file", ["../outside/x.safetensors", "ABSOLUTE", "link.safetensors"],
                         ids=["dot-dot", "absolute", "symlink-out"])
def test_a_hugging_face_index_naming_a_file_outside_its_folder_is_refused(tmp_path, file):
    hf, outside = _hf_folder(tmp_path, str(tmp_path / "outside/x.safetensors") if file == "ABSOLUTE" else file)
    os.symlink(outside / "x.safetensors", hf / "link.safetensors")
    with pytest.raises(CheckpointError, match="its index names a file outside the folder"):
        CheckpointSource(str(hf))


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(tmp_path):
    """huggingface_hub's cache: snapshots/<revision>/ holds links to the files in ../../blobs/."""
    from safetensors.torch import save_file

    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(repo / "blobs" / "0123"))
    os.symlink("../../blobs/0123", repo / "snapshots" / "abc" / "model.safetensors")
    assert torch.equal(CheckpointSource(str(repo / "snapshots" / "abc")).full("w"), torch.ones(2))


@pytest.mark.parametrize("text", ["not json", "[]", '{"weight_map": {"w": 3}}'])
def test_a_malformed_hugging_face_index_is_refused_with_a_message(tmp_path, text):
    hf, _ = _hf_folder(tmp_path, "x.safetensors")
    (hf / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{hf}: its index model.safetensors.index.json"):
        CheckpointSource(str(hf))


def test_export_reads_a_shared_or_changed_checkpoint_only_when_told_to(saved, tmp_path, capsys):
    from pardsl import cli

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by everyone, no sticky bit
    folder = shutil.copytree(saved, shared / "step-1")
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["export", str(folder), "-o", out]) == 1
    assert "pass --allow-shared-folder" in capsys.readouterr().err and not os.path.exists(out)
    assert cli.main(["export", str(folder), "-o", out, "--allow-shared-folder"]) == 0

    changed = shutil.copytree(saved, tmp_path / "changed")
    data = next(name for name in os.listdir(changed) if name.endswith(".safetensors"))
    with open(changed / data, "r+b") as handle:
        handle.seek(os.path.getsize(changed / data) - 64)
        handle.write(b"\xff" * 64)  # inside the last tensor's bytes, the size unchanged
    assert cli.main(["export", str(changed), "-o", out]) == 1
    assert "pass --no-verify" in capsys.readouterr().err
    assert cli.main(["export", str(changed), "-o", out, "--no-verify"]) == 0


def test_a_group_is_private_only_where_no_other_user_has_it_as_their_primary_group(monkeypatch):
    import grp
    import pwd

    from pardsl.runtime import checkpoint

    me = pwd.getpwuid(os.geteuid())
    private = grp.struct_group((me.pw_name, "x", 4242, []))
    monkeypatch.setattr(grp, "getgrgid", lambda gid: private)
    monkeypatch.setattr(pwd, "getpwall", lambda: [me])
    assert checkpoint._group_of_mine_alone(4242)
    # a member the group's list does not name: another user whose primary group it is
    other = pwd.struct_passwd(("mallory", "x", 4243, 4242, "", "/home/mallory", "/bin/sh"))
    monkeypatch.setattr(pwd, "getpwall", lambda: [me, other])
    assert not checkpoint._group_of_mine_alone(4242)
