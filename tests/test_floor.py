"""The durable floor (`replica launch --durable DIR`): standbys write every K-th global commit
to DIR in the background; a version counts once every rank's part is written and its signed
manifest names it; each standby keeps the newest two; a write that fails is warned and counted
and the job goes on. Real jobs (`replica launch`, the FSDP2 example), real files."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from replica.errors import ReplicaError
from replica.jobstore import FloorVersion, JobStore, keys
from replica.jobstore.commit import CommitRecord
from replica.jobstore.etcd import EtcdStore
from replica.mirror.floor import MANIFEST, FloorConfig, drop_half_written, manifest_file, verify_manifest_file
from replica.roles.env import PHASES
from replica.roles.report import compare_reports
from replica.state.export import export_path, load_export, load_extras, step_folder
from support.launch import RL, RL_STEPS, STEPS, launch
from support.ports import free_port
from support.vllm_engine import vllm_available

TOKEN = "a-token-for-the-floor-tests"
DCP_READ = Path(__file__).parent / "jobs" / "dcp_read.py"
STALL_FOR_VERSION_3 = "stall:trainer:0@4:2"  # the pair-loss tests' room for version 3 to complete


def test_floor_settings_are_checked():
    with pytest.raises(ValueError, match="needs a cadence"):
        FloorConfig(directory=Path("d"), every_steps=0, interval=timedelta(0))
    with pytest.raises(ValueError, match="every_steps must be >= 0"):
        FloorConfig(directory=Path("d"), every_steps=-1)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        FloorConfig(directory=Path("d"), keep=0)


def test_a_manifest_file_is_signed_with_the_jobs_token():
    version = FloorVersion(
        step=6,
        directory="/d",
        files=("step00000006/rank00000.safetensors",),
        nbytes=(10,),
        digests=(123,),
        fingerprints=("f",),
        written_at=1.0,
    )
    data = manifest_file(version, b"key")
    assert verify_manifest_file(data, b"key")["step"] == 6
    with pytest.raises(ReplicaError, match="signature does not match"):
        verify_manifest_file(data, b"another job's key")
    with pytest.raises(ReplicaError, match="signature does not match"):
        verify_manifest_file(data.replace(b'"step": 6', b'"step": 7'), b"key")
    with pytest.raises(ReplicaError, match="not a replica floor manifest"):
        verify_manifest_file(b"[]", b"key")


def test_the_standby_that_completes_a_version_drops_every_ranks_half_written_older_ones(tmp_path):
    """Version 6 was left half-written (rank 0's standby died before its part) and rank 1's
    standby closed before version 9 completed, its part of 6 still there: the standby whose part
    completes 9 deletes it. Complete versions, newer ones and what is not a part stay."""
    store = JobStore(
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)),
        token=TOKEN.encode(),
    )
    for step, ranks in ((3, (0, 1)), (6, (1,)), (9, (0, 1)), (12, (1,))):
        for rank in ranks:
            export_path(step_folder(tmp_path, step), rank).parent.mkdir(exist_ok=True)
            export_path(step_folder(tmp_path, step), rank).write_bytes(b"part")
    (tmp_path / "notes.txt").write_text("the user's")
    for step in (3, 9):
        store.put(
            keys.floor_version(step),
            FloorVersion(
                step=step, directory=str(tmp_path), files=(), nbytes=(), digests=(), fingerprints=(), written_at=1.0
            ),
        )
    assert drop_half_written(tmp_path, 9, store) == [6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step00000003", "step00000009", "step00000012"]
    assert drop_half_written(tmp_path, 9, store) == []  # nothing more to drop


def test_versions_are_complete_the_newest_two_kept_and_a_resume_from_one_is_bit_identical(tmp_path):
    """Every third step is written by both standbys (one skipped while a write is still going on,
    as under load); the versions written are complete (their manifests in the job store), the
    folder holds the newest two, each with its signed manifest and every rank's file, whose
    content checks against its digests. The newest is a checkpoint that
    ``torch.distributed.checkpoint.load`` reads, model and optimizer, into the job's model at 2
    ranks (FSDP2) and at 1: every tensor equal to the commit's. A job resumed from the older one
    computes the steps after it exactly as the first did."""
    floor = tmp_path / "floor"
    env = {"REPLICA_TOKEN": TOKEN}
    code, report, output = launch(
        tmp_path, "--durable", str(floor), "--durable-every", "3", "--durable-interval", "0", steps=STEPS, env=env
    )
    assert code == 0, output[-4000:]
    # A standby writes one version at a time and skips one that comes meanwhile (by design): under
    # load the write of 3 may outlast three steps, and 6 is skipped.
    versions = report["floor"]["versions"]
    assert set(versions) <= {3, 6, 9} and len(versions) >= 2 and versions == sorted(versions), report["floor"]
    assert report["floor"]["latest"] == versions[-1] and report["floor"]["errors"] == 0, report["floor"]
    older, newest = versions[-2:]
    assert sorted(p.name for p in floor.iterdir()) == [f"step{older:08d}", f"step{newest:08d}"]
    for step in (older, newest):
        folder = step_folder(floor, step)
        manifest = verify_manifest_file((folder / MANIFEST).read_bytes(), TOKEN.encode())
        assert manifest["step"] == step and len(manifest["files"]) == 2
        for rank in (0, 1):
            path = export_path(folder, rank)
            assert path.stat().st_size == manifest["nbytes"][rank]
            assert load_export(path).step == step  # checked against the digests written with it
    # torch's own reader takes the newest version for a DCP checkpoint, at the job's 2 ranks and at 1.
    for world in (2, 1):
        for rank, result in enumerate(read_with_dcp(tmp_path, step_folder(floor, newest), world)):
            assert result["tied"] == {"model.head.weight": "model.embed.weight"}, result["tied"]
            assert result["expected"] and sorted(result["compared"]) == sorted([*result["expected"], *result["tied"]])
            assert result["differ"] == [], (world, rank, result["differ"])
    extras = load_extras(export_path(step_folder(floor, newest), 1))  # what the tensors leave out, decoded
    assert sorted(extras["extra"]) == ["loader", "rng", "scheduler"], sorted(extras["extra"])
    assert extras["extra"]["scheduler"]["last_epoch"] == newest and extras["param_groups"][0]["weight_decay"] == 0.1
    code, resumed, output = launch(
        tmp_path, "--resume", str(step_folder(floor, older)), name="resumed", steps=STEPS, env=env
    )
    assert code == 0, output[-4000:]
    for rank in ("0", "1"):
        assert resumed["losses_hex"][rank][older:] == report["losses_hex"][rank][older:], rank
        assert resumed["losses_hex"][rank][older:] and None not in resumed["losses_hex"][rank][older:]


def test_a_killed_standbys_half_written_version_is_never_complete(tmp_path):
    """Standby 0 is killed in step 6: the version 6 it was to write with the others' is (most
    often) never named by a manifest; its replacement writes the rank's parts from then on, and
    once a newer version is complete the other standbys drop their parts of the half-written one:
    only complete versions stay on the floor. Meanwhile rank 0 trains on unprotected, backed by
    the floor, instead of waiting for the replacement in commit() (trainer 0 stalls 8 s in steps 7
    and 8, below gloo's 10 s timeout, to leave the replacement time to come before the job ends:
    on a loaded machine 6 s were not enough to start it, build its model and send it the state)."""
    floor = tmp_path / "floor"
    code, report, output = launch(
        tmp_path,
        "--durable",
        str(floor),
        "--durable-every",
        "3",
        "--durable-interval",
        "0",
        "--inject",
        "kill:standby:0@6,stall:trainer:0@7:8,stall:trainer:0@8:8",
        steps=STEPS,
    )
    assert code == 0, output[-4000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]
    assert report["standbys_replaced"], "the standby was not replaced"
    assert "training goes on meanwhile, backed by the durable floor" in output, output[-4000:]
    (span,) = report["unprotected_spans"]
    assert span["rank"] == 0 and span["until_commit"] is not None, span  # protected again by the replacement
    versions = report["floor"]["versions"]
    assert 9 in versions, report["floor"]  # the replacement wrote rank 0's part of step 9
    # The dead standby's parts went with the versions they belong to: its replacement prunes the rank's files.
    kept = sorted(p.name for p in floor.iterdir())
    assert kept == [step_folder(floor, s).name for s in versions[-2:]], (kept, versions)
    for folder in floor.iterdir():
        assert (folder / MANIFEST).exists() and all(export_path(folder, r).exists() for r in (0, 1)), folder


def read_with_dcp(tmp_path: Path, folder: Path, world: int) -> list[dict]:
    """Each rank's findings of tests/jobs/dcp_read.py reading ``folder`` at ``world`` ranks."""
    outs = [tmp_path / f"dcp-{world}-{rank}.json" for rank in range(world)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(DCP_READ),
                str(folder),
                str(world),
                str(rank),
                str(tmp_path / f"dcp-init-{world}"),
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, out in enumerate(outs)
    ]
    for proc in procs:
        output = proc.communicate(timeout=180)[0]
        assert proc.returncode == 0, output[-4000:]
    return [json.loads(out.read_text()) for out in outs]


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("options,said", [("size=64k", "no space left"), ("size=1m,ro", "a read-only file system")])
def test_a_floor_that_cannot_be_written_is_warned_once_and_the_job_goes_on(tmp_path, options, said):
    """A durable folder with no room (a 64 KiB tmpfs: ENOSPC), or read-only (EROFS): each
    standby warns once, the failed parts are counted in the report, no version is complete,
    and the job ends as it would without a floor."""
    with _tmpfs(tmp_path / "floor", options) as floor:
        code, report, output = launch(
            tmp_path, "--durable", str(floor), "--durable-every", "3", "--durable-interval", "0", steps=STEPS
        )
    assert code == 0, output[-4000:]
    assert report["last_commit"] == STEPS
    assert report["floor"]["versions"] == [] and report["floor"]["errors"] >= 4, report["floor"]  # 3 versions x 2
    warnings = [line for line in output.splitlines() if "durable floor: could not write" in line]
    assert len(warnings) == 2 and all(said in w for w in warnings), warnings  # once per standby


def test_a_version_at_least_every_interval(tmp_path):
    """--durable-every 0: the versions come by time, planned by rank 0's standby two commits
    ahead so that every standby still holds the step when it is committed."""
    code, report, output = launch(
        tmp_path, "--durable", str(tmp_path / "floor"), "--durable-every", "0", "--durable-interval", "0.3", steps=40
    )
    assert code == 0, output[-4000:]
    versions = report["floor"]["versions"]
    assert versions and report["floor"]["errors"] == 0, report["floor"]
    assert replace(FloorConfig(directory=Path("d")), every_steps=0).interval == timedelta(minutes=10)  # the default


def _pair_loss_cases() -> list[tuple[str, str]]:
    """A standby killed, then its trainer two steps later (the standby's kill fires once trainer 0
    logged its step: killed "together", the trainer would often go first and its standby be
    promoted, which is no pair loss). Each assertion's message names the faults injected."""
    # The standby dies after version 3 is written: the floor has a version to go back to. (Trainer 0
    # stalls 2 s in step 4 so that it is: on a loaded machine a standby's writes, fsyncs included,
    # lagged two steps behind, and the version it was killed in the middle of never completed.)
    step, phase = random.Random().choice([(step, phase) for step in range(7, 10) for phase in PHASES])
    # (The standby, then its trainer in the backward two steps later: the rotten-version test below.)
    room = f"{STALL_FOR_VERSION_3},"
    return [
        (
            f"{room}kill:standby:1@6,kill:trainer:1@8:optimizer",
            "the standby while it writes version 6, then its trainer",
        ),
        (f"{room}kill:standby:1@{step - 2},kill:trainer:1@{step}:{phase}", "a random step and phase"),
    ]


@pytest.mark.parametrize("inject,what", _pair_loss_cases(), ids=["mid-flush", "random"])
def test_a_trainer_lost_with_its_standby_resumes_from_the_floor_bit_identically(tmp_path, reference, inject, what):
    """Rank 1's trainer and its standby are both lost (no replacement allowed): its state is in
    no memory any more. The job does not end: every rank goes back to the floor's newest
    complete version and replays from there; the whole run equals the failure-free one. The
    mid-flush case hosts the job store on a fixed --port: the next attempt keeps that store."""
    port = ("--port", str(free_port())) if "write" in what else ()
    code, report, output = launch(
        tmp_path,
        "--durable",
        str(tmp_path / "floor"),
        "--durable-every",
        "3",
        "--durable-interval",
        "0",
        "--replacements",
        "0",
        "--inject",
        inject,
        *port,
        steps=STEPS,
    )
    assert code == 0, (what, inject, output[-6000:])
    fired = [f["fault"] for f in report["faults"] if f["fired_at"] is not None]
    assert len(fired) == len(report["faults"]) == 3, (inject, report["faults"])
    (resumed,) = [r for r in report["restarts"] if "resumed_from_floor" in r]
    version = resumed["resumed_from_floor"]
    assert version % 3 == 0 and version <= resumed["lost_commit"], resumed
    assert "state is lost" in resumed["reason"], resumed
    assert f"the job goes back to the durable floor's version of step {version}" in output, output[-4000:]
    assert compare_reports(reference, report) == [], (what, inject)
    assert report["last_commit"] == STEPS
    print(f"{what} ({inject}): resumed from version {version}, {resumed['lost_commit'] - version} steps replayed")


def test_a_rotten_part_of_the_newest_version_is_found_and_the_one_before_used(tmp_path, reference, etcd):
    """Standby 0's part of version 6 rots once written (``corrupt:standby:0@6``: a byte flipped
    on disk); later rank 1 loses its standby (step 8) and then its trainer (step 9). Going back
    to the floor, the launcher reads version 6 back, finds the flipped byte, says so and resumes
    from version 3 instead: the run still equals the failure-free one. The job's state is in a
    real etcd cluster: the next attempt's lives under its own prefix in the same namespace."""
    inject = "corrupt:standby:0@6,stall:trainer:0@7:2,kill:standby:1@8,kill:trainer:1@9:backward"  # (stall: as in
    # _pair_loss_cases, time for version 6 to complete)
    namespace = f"{etcd.namespace}floor-{tmp_path.name}/"
    code, report, output = launch(
        tmp_path,
        "--durable",
        str(tmp_path / "floor"),
        "--durable-every",
        "3",
        "--durable-interval",
        "0",
        "--replacements",
        "0",
        "--inject",
        inject,
        "--store",
        f"etcd://{etcd.endpoints}/{namespace}",
        steps=STEPS,
        env={**etcd.environ(), "REPLICA_TOKEN": TOKEN},
    )
    assert code == 0, output[-6000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]  # the byte was flipped
    (resumed,) = [r for r in report["restarts"] if "resumed_from_floor" in r]
    assert resumed["resumed_from_floor"] == 3, (resumed, output[-4000:])
    assert "the durable floor's version of step 6 is not usable (rank 0's part" in output, output[-4000:]
    assert "the job goes back to the durable floor's version of step 3" in output, output[-4000:]
    assert compare_reports(reference, report) == []
    assert report["last_commit"] == STEPS
    # Each attempt's commit record in etcd, apart: the first's ends at the commit it lost, the second's at the end.
    job = JobStore(EtcdStore(etcd.config(namespace=namespace)), token=TOKEN.encode())
    (resumed,) = [r for r in report["restarts"] if "resumed_from_floor" in r]
    assert [CommitRecord(job.attempt(n), world_size=2).last() for n in (0, 1)] == [resumed["lost_commit"], STEPS]


@pytest.mark.slow
def test_the_rl_loop_resumes_from_the_floor_with_the_same_rollouts(tmp_path, rl_reference):
    """The RL loop with vLLM engines: trainer 1 and its standby lost. Every role starts again from
    the floor's newest version; the replayed steps' rollouts come out the same, so the losses and
    the rewards equal the failure-free run's."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    code, report, output = launch(
        tmp_path,
        "--rollouts",
        "2",
        "--durable",
        str(tmp_path / "floor"),
        "--durable-every",
        "2",
        "--durable-interval",
        "0",
        "--replacements",
        "0",
        "--inject",
        "kill:standby:1@3,kill:trainer:1@5:backward",
        steps=RL_STEPS,
        script=RL,
        timeout_s=480,
    )
    assert code == 0, output[-6000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]
    (resumed,) = [r for r in report["restarts"] if "resumed_from_floor" in r]
    assert resumed["resumed_from_floor"] == 2, resumed
    assert compare_reports(rl_reference, report) == []
    assert all(m.get("reward") for m in report["metrics_hex"]["0"])  # every step scored, replayed ones too
