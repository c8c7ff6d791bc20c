"""Data parallel over torch.distributed (gloo, 2 CPU processes launched the way torchrun does:
RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_* in the environment).

One launch of 2 ranks runs several trainings back to back (``dist_child.py``, forked by
``multiproc``); the single-process references run in this process. Every comparison is of the exported fp32 weights. Rank 0 runs
under umask 022 and the other ranks under umask 077, so every file tells which rank created it
(a blob is created with mode 0644 less the umask): 0644 rank 0, 0600 another rank.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import multiproc
from layerwise import config
from layerwise.ckpt.resolve import open_run_step
from layerwise.ckpt.run_dir import RunDir
from layerwise.ckpt.provider import PARAM
from layerwise.models import get_flavor
from layerwise.optim.adamw import state_nbytes as fp32_state_nbytes
from layerwise.plan.plan import Plan
from layerwise.plan.owners import assign_owners
from layerwise.store import init_store, store_footprint
from layerwise.train.dist.saving import group_writers
from layerwise.train.loop import TrainConfig, train

sys.path.insert(0, str(Path(__file__).parent))
from dist_child import BASE, main as child_main  # noqa: E402
from tiny_hf import make_model_dir  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
STEPS = 10
RANK0_UMASK, OTHER_UMASK = 0o022, 0o077


def _launch(tmp: Path, runs: list[dict], world: int = 2,
            name: str = "launch") -> multiproc.Launch:
    """``world`` ranks running ``runs`` one after the other (``dist_child.main``), each run's
    process group joined through a store of its own that this process holds; rank 0 under
    umask 022, the others under 077; output in ``<name>.<rank>.log``."""
    stores = [multiproc.Store() for _ in runs]
    runs = [{**run, "port": st.port} for run, st in zip(runs, stores)]
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(runs))
    return multiproc.start(child_main, (str(spec),), world, log=tmp / name, stores=stores,
                           umasks=[RANK0_UMASK] + [OTHER_UMASK] * (world - 1))


def _run(out: Path, *overrides: str) -> Path:
    """A single-process reference, on one thread as the ranks are (``OMP_NUM_THREADS=1``):
    on some CPUs a 2-thread matmul rounds differently, and AdamW turns that into ~1e-4."""
    cfg = config.apply_overrides(TrainConfig(**BASE), [f"out_dir={out}", *overrides])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg)
    finally:
        torch.set_num_threads(threads)
    return out


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        tensors.update(load_file(f))
    assert tensors
    return tensors


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def _moments_plan(path: Path, mbs: int, accum: int) -> Path:
    layers = get_flavor("llama-debug").build_config().num_hidden_layers
    plan = Plan.every_k(layers, 2, micro_batch_size=mbs, num_micro_batches=accum,
                        seq_len=BASE["seq_len"])
    plan.moments = ["8bit", "fp32", "8bit", "8bit", "fp32", "8bit"][:layers + 2]
    plan.save(path)
    return path


def _layer_major_plan(path: Path, accum: int) -> Path:
    """Every micro-batch of the step through each op on one weight load, layer 1 resident."""
    layers = get_flavor(BASE["model"]).build_config().num_hidden_layers
    Plan.every_k(layers, 2, micro_batch_size=1, num_micro_batches=accum, seq_len=BASE["seq_len"],
                 micro_batches_per_load=accum, resident_layers=[1]).save(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank launch of trainings with 1 row per rank, plus the checkpoint hand-overs
    between world sizes, and the single-process references (global micro-batch of 2 rows),
    which run here while the ranks run (they take one core; the ranks wait on each other)."""
    tmp = tmp_path_factory.mktemp("dist")
    # 8-bit moments turn round-off into whole quantisation steps (one process with 2 rows per
    # micro-batch and with 1 row x 2 micro-batches differ by ~6e-4), so their reference adds
    # the same per-row gradients the 2 ranks reduce: 1 row x 2 micro-batches. And an untied
    # model: a tied embedding's gradient arrives in two parts per micro-batch (head, then
    # embedding), which one process adds in another order than the reduction does.
    p8_1 = _moments_plan(tmp / "plan8_1.json", 1, 1)
    p8_ref = _moments_plan(tmp / "plan8_ref.json", 1, 2)
    untied = make_model_dir(tmp / "untied")
    p_lm = _layer_major_plan(tmp / "plan_lm.json", 2)
    steps = f"steps={STEPS}"
    # 1 process saves at step 6; 2 ranks resume it to the end
    _run(tmp / "p1_to_r2", "steps=6", "micro_batch_size=1", "grad_accum=2", "ckpt.every=3",
         "ckpt.policy=full", "export=false")
    # the same with 8-bit moments, resumed by 1 process and by 2 ranks
    _run(tmp / "p1_to_p1_8bit", "steps=6", f"plan={p8_ref}", f"model={untied}", "ckpt.every=3",
         "ckpt.policy=full", "export=false")
    shutil.copytree(tmp / "p1_to_p1_8bit", tmp / "p1_to_r2_8bit")
    shm_dir = Path("/dev/shm") / f"layerwise-test-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()
    try:
        common = ["micro_batch_size=1", f"dist.shm_dir={shm_dir}"]
        two = [
            {"overrides": [f"out_dir={tmp / 'r2_plain'}", steps, *common],
             "memory": str(tmp / "mem"), "copied": str(tmp / "copied_device")},
            {"overrides": [f"out_dir={tmp / 'r2_accum'}", steps, "grad_accum=2", *common]},
            # the host path (each rank lands its own gradient, gloo sums the host copies)
            {"overrides": [f"out_dir={tmp / 'r2_plain_host'}", steps, "dist.grad_reduce=host",
                           *common]},
            # (asynchronous: the synchronous backend adds a host gradient without a copy)
            {"overrides": [f"out_dir={tmp / 'r2_accum_host'}", steps, "grad_accum=2",
                           "dist.grad_reduce=host", "device=cpu-async", *common],
             "copied": str(tmp / "copied_host")},
            # the device path on the asynchronous backend: the reduction lane a thread of its own
            {"overrides": [f"out_dir={tmp / 'r2_accum_async'}", steps, "grad_accum=2",
                           "device=cpu-async", *common]},
            {"overrides": [f"out_dir={tmp / 'r2_8bit'}", steps, f"plan={p8_1}", f"model={untied}",
                           *common]},
            # layer-major (gradients summed over the step on the device, reduced once) and a
            # resident layer (refreshed after its owner publishes its update)
            {"overrides": [f"out_dir={tmp / 'r2_accum_lm'}", steps, f"plan={p_lm}",
                           "device=cpu-async", *common]},
            {"overrides": [f"out_dir={tmp / 'r2_to_p1'}", "steps=6", "ckpt.every=3",
                           "ckpt.policy=full", "export=false", *common]},
            {"overrides": [f"out_dir={tmp / 'p1_to_r2'}", steps, *common]},
            {"overrides": [f"out_dir={tmp / 'p1_to_r2_8bit'}", steps, f"plan={p8_1}",
                           f"model={untied}", *common]},
            # two "nodes" of one rank each: a store per node, the all-reduce across nodes,
            # each node's rank writing its groups of the checkpoints
            {"overrides": [f"out_dir={tmp / 'r2_nodes'}", steps, "ckpt.every=5",
                           "ckpt.policy=full", *common],
             "env": {"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}},
        ]
        with _launch(tmp, two) as ranks:
            ref = {
                "plain": _run(tmp / "ref_plain", steps, "micro_batch_size=2"),
                "accum": _run(tmp / "ref_accum", steps, "micro_batch_size=2", "grad_accum=2"),
                "8bit": _run(tmp / "ref_8bit", steps, f"plan={p8_ref}", f"model={untied}"),
                # the hand-overs' reference: 1-row micro-batches, 2 a step, so that a resume
                # between this and 2 ranks (one 2-row global micro-batch a step) converts the
                # data position
                "rows": _run(tmp / "ref_rows", steps, "micro_batch_size=1", "grad_accum=2"),
            }
            _run(tmp / "p1_to_p1_8bit", steps, f"plan={p8_ref}", f"model={untied}")
            ranks.wait(timeout_s=400)
        # 2 ranks saved at step 6; 1 process resumes it to the end
        # (no checkpoint of its own at the end: the saves compared are the 2 ranks')
        _run(tmp / "r2_to_p1", steps, "micro_batch_size=1", "grad_accum=2", "ckpt.at_end=false")
        yield dict(tmp=tmp, ref=ref, shm_dir=shm_dir)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.mark.parametrize("kind", ["plain", "accum", "8bit", "plain_host", "accum_host",
                                  "accum_async", "accum_lm"])
def test_two_ranks_train_the_same_weights_as_one_process(runs, kind):
    """10 steps of 2 ranks x 1 row equal 1 process x 2 rows (fp32, max abs diff <= 1e-5), plain,
    with gradient accumulation (2 micro-batches) and with 8-bit moments on half the units (whose
    reference takes the 2 rows as 2 micro-batches: see ``runs``); and rank 0 logs the loss and
    gradient norm of the whole global batch. Gradients reduced on the device (the default: on the
    synchronous backend, and ``accum_async`` on the asynchronous one) and on the host (``_host``);
    ``accum_lm``: layer-major order (one reduction per unit a step) with a resident layer.

    Mutations seen failing: ``DistReducer.global_tokens`` returning the local count (each rank
    normalises by its own tokens: the logged loss and norm double; the weights, AdamW being
    nearly scale-free, move by ~6e-5 through the clip); ``unit_landed`` not reducing (each
    owner steps on its own rank's gradient: diff ~3e-2); ``update_done`` not waiting for the
    owner's counter (a rank streams weights its owner has not updated yet: diff ~1e-2);
    ``DistReducer.reduce_on_device`` reducing nothing (``plain``, ``accum``, ``8bit``,
    ``accum_async``: each owner steps on its own rank's gradient); the engine's resident
    refresh not marked stale after an update (``accum_lm``)."""
    ref, two = runs["ref"][kind.split("_")[0]], runs["tmp"] / f"r2_{kind}"
    diff = _max_diff(ref, two)
    assert diff <= 1e-5, diff
    rows = [[json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (ref, two)]
    assert len(rows[0]) == len(rows[1]) == STEPS
    for a, b in zip(*rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["target_tokens"] == b["target_tokens"]


@pytest.mark.parametrize("mode", ["device", "host"])
def test_only_the_owner_copies_a_reduced_gradient_out(runs, mode):
    """The bytes each rank's D2H lane moved in the 10 steps (its engine's own counter): with the
    reduction on the device (``r2_plain``), exactly the gradients of the units the rank owns
    (the tied embedding twice a micro-batch: the head's part, then its own backward's); on the
    host path (``r2_accum_host``, 2 micro-batches a step), every unit's, on both ranks. (The
    plan keeps boundaries on the device or recomputes them: the lane carries gradients only.)

    Mutation seen failing: ``GradSink._out`` taking every unit as this rank's (``mine =
    True``: a non-owner copies its spent part out too, every unit's bytes on both ranks)."""
    _, store = init_store(get_flavor("llama-demo").build_config())
    owners = assign_owners([b.layout.numel for b in store], 2)

    micro_batches = STEPS * (1 if mode == "device" else 2)

    def grad_bytes(units) -> int:
        return micro_batches * sum(b.layout.numel * 4 * (2 if b.name == "embed" else 1)
                                   for b in units)

    for rank in range(2):
        got = json.loads((runs["tmp"] / f"copied_{mode}.{rank}").read_text())["d2h"]
        mine = [b for b, o in zip(store, owners) if o == rank] if mode == "device" else list(store)
        assert got == grad_bytes(mine), (rank, got, grad_bytes(mine))


def test_two_single_rank_nodes_train_the_same_weights(runs):
    """LOCAL_WORLD_SIZE=1 on 2 ranks: two nodes, each with its own shared store, each owner
    (the only local rank) all-reducing every unit's gradient with the other node's and applying
    the same update to its node's copy.

    Mutation seen failing: contributing the squared norms on every node instead of node 0 only
    (the clip norm counts each unit twice: diff ~5e-4)."""
    diff = _max_diff(runs["ref"]["plain"], runs["tmp"] / "r2_nodes")
    assert diff <= 1e-5, diff


def _creators(ckpt: Path) -> dict[int, dict[str, int]]:
    """Per committed step, each group's blob -> the rank whose process created the file, read
    from its mode (``_launch``'s umasks): 0 for 0644, 1 for 0600 (2 ranks here)."""
    out = {}
    for step in RunDir.open(ckpt).committed_steps():
        entries = json.loads((ckpt / "steps" / f"{step:012d}" / "manifest.json").read_text())["groups"]
        modes = {g: (ckpt / e["blob"]).stat().st_mode & 0o777 for g, e in entries.items()}
        assert set(modes.values()) <= {0o644 & ~RANK0_UMASK, 0o644 & ~OTHER_UMASK}, modes
        out[step] = {g: 0 if m == 0o644 & ~RANK0_UMASK else 1 for g, m in modes.items()}
    return out


def _demo_group_writers() -> dict[str, int]:
    _, store = init_store(get_flavor("llama-demo").build_config())
    return group_writers(store, 2)


def test_each_rank_writes_its_own_groups_of_a_save(runs):
    """Both saves of a 2-rank run (steps 3 and 6) hold blob files created by rank 1's process
    (told from the outside by the file modes its umask gives them), exactly the groups dealt to
    rank 1, and the rest by rank 0's. The same run resumes in one process to the uninterrupted
    run's weights (``test_checkpoints_resume_across_world_sizes``).

    Mutation seen failing: ``saving.checkpointer`` giving rank 0 every group and rank 1 none
    (rank 0 writes the whole save: every blob 0644)."""
    expected = _demo_group_writers()
    assert set(expected.values()) == {0, 1}
    got = _creators(runs["tmp"] / "r2_to_p1" / "ckpt")
    assert list(got) == [3, 6]
    for step, creators in got.items():
        assert creators == expected, (step, creators)


def test_each_node_writes_its_groups_from_its_own_copy(runs):
    """Two single-rank nodes: node 1's rank writes its groups of the checkpoints from its
    node's copy of the store (mode 0600: its process made the files), and the last checkpoint
    (step 10) holds exactly the weights rank 0 exported at the end.

    Mutation seen failing: ``group_writers`` dealing the groups over the local world size
    (1 here: node 0 writes everything)."""
    out = runs["tmp"] / "r2_nodes"
    got = _creators(out / "ckpt")
    assert list(got) == [5, 10] and got[10] == _demo_group_writers(), got
    exported, rs = _weights(out), open_run_step(out / "ckpt", 10)
    params = {k[len(PARAM):]: t for g in rs.groups() for k, t in rs.load_group(g).items()
              if k.startswith(PARAM)}
    assert params.keys() == exported.keys()
    assert all(torch.equal(params[k], exported[k]) for k in params)


def test_checkpoints_resume_across_world_sizes(runs):
    """A run checkpointed by 2 ranks at step 6 and resumed by 1 process, and one checkpointed
    by 1 process and resumed by 2 ranks, end where the uninterrupted run ends. The single
    process takes 1-row micro-batches, 2 a step, so each hand-over converts the data position
    (12 micro-batches of 1 row = 6 global micro-batches of 2).

    Mutation seen failing: ``_data_start`` ignoring ``data_rows_per_micro_batch`` (both
    hand-overs restart the data at the wrong rows)."""
    for out in ("r2_to_p1", "p1_to_r2"):
        diff = _max_diff(runs["ref"]["rows"], runs["tmp"] / out)
        assert diff <= 1e-5, (out, diff)
    metrics = [json.loads(x) for x in (runs["tmp"] / "r2_to_p1" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))


def test_an_8bit_checkpoint_resumes_the_same_in_2_ranks_as_in_1_process(runs):
    """One 8-bit checkpoint (step 6 of 1 process), resumed to step 10 by 1 process and by 2
    ranks: equal weights. Rank 1 did not load the checkpoint (its node's local rank 0 did, into
    the shared store), yet its 8-bit units' bias correction must count from the saved step.

    Mutation seen failing: ``setup.resume`` not re-reading ``HostSteps`` on the ranks that did
    not load (rank 1's units restart their step count at 0)."""
    diff = _max_diff(runs["tmp"] / "p1_to_p1_8bit", runs["tmp"] / "p1_to_r2_8bit")
    assert diff <= 1e-5, diff


def test_the_two_ranks_hold_one_host_store_not_two(runs):
    """Measured from /proc: the shared memory the two ranks hold (their ``Pss_Shmem``, which
    splits each shared page between the processes mapping it) adds up to one store's master
    weights and optimizer state (fp32 compute: the master is the copy source), within 10% plus
    a page per buffer; and nothing is left in the shm directory.

    Mutation seen failing: the store built through a per-rank allocator (every rank creating
    its own files; the update counters still shared): 14.8 MB held for an 11.0 MB store."""
    cfg = get_flavor("llama-demo").build_config()
    fp = store_footprint(cfg, torch.float32)
    shared = fp.total - fp.grad + fp32_state_nbytes(fp.numel)  # masters + fp32 moments
    per_rank = [json.loads((runs["tmp"] / f"mem.{r}").read_text()) for r in range(2)]
    held = sum(s["Pss_Shmem"] for s in per_rank) * 1024
    buffers = 6 * 4  # units x (master, exp_avg, exp_avg_sq, step), one page each at most
    assert abs(held - shared) <= 0.1 * shared + buffers * 4096 + 64 * 1024, (held, shared)
    assert list(runs["shm_dir"].iterdir()) == []


TIMEOUT_S = 10
"""``dist_timeout_s`` of the lost-rank tests: what they wait out when a rank is stalled. It
bounds every collective of the run, also those before the loss, so it must stay well above
the worst skew between two healthy ranks on a loaded machine (at 5 s, one stressed run of
``tests/stress_dist.py`` at load 13 had a rank end before the fault, in both blob-write tests)."""


def _lose_a_rank(tmp: Path, shm_dir: Path, lose, ready, fault: dict | None = None,
                 shm_empty: bool = False) -> None:
    """Launch 2 ranks on an endless run with a checkpoint every step; once ``ready()`` (polled),
    ``lose(rank1)``; rank 0 must then exit with an error within ``TIMEOUT_S`` plus 5 s of slack,
    naming the timeout and the way back (and, ``shm_empty``, leave ``shm_dir`` empty while
    rank 1 is still there, stalled or a corpse)."""
    run = {"overrides": [f"out_dir={tmp / 'run'}", "steps=100000", "micro_batch_size=1",
                         "ckpt.every=1", "ckpt.policy=full", "export=false",
                         f"dist.timeout_s={TIMEOUT_S}", f"dist.shm_dir={shm_dir}"]}
    if fault is not None:
        run["stall_in_blob_writes"] = fault
    with _launch(tmp, [run], name="kill") as ranks:
        try:
            multiproc.wait_for(ready, 240, "the moment to lose rank 1",
                               alive=lambda: ranks[0].poll() is None and ranks[1].poll() is None)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{ranks.logs()}") from None
        lose(ranks[1])
        lost = time.monotonic()
        try:
            ranks[0].wait(TIMEOUT_S + 20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank 0 still running\n{ranks.logs()}") from None
        waited = time.monotonic() - lost
        text = ranks[0].log_tail(100_000)
        assert ranks[0].returncode not in (0, None) and waited <= TIMEOUT_S + 5, (waited, text[-3000:])
        assert f"dist.timeout_s={TIMEOUT_S}" in text and "resume=true" in text, text[-3000:]
        if shm_empty:
            assert list(shm_dir.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_a_lost_rank_ends_the_other_with_an_error_within_the_timeout(tmp_path, sig):
    """Rank 1 is killed (SIGKILL: gloo sees the connection close) or stalled (SIGSTOP: only the
    timeouts can tell) in the middle of training, while rank 0 saves a checkpoint every step;
    rank 0 exits with an error that names the timeout, within ``dist_timeout_s`` (plus slack),
    the shm directory is empty (the store's files are unlinked as soon as both ranks mapped
    them), ``ckpt verify`` finds the checkpoints clean, and one process resumes from them.

    Mutations seen failing: no timeout on the process group (``init_process_group`` without
    ``timeout=``: the stalled case waits the default 30 minutes, past the test's limit); the
    device-reduction group made without ``timeout=`` (``DistReducer._groups``: torch's
    ``new_group`` does not inherit it; the stalled case hangs when the stall lands in a
    gradient reduction: 1 of 2 stress runs, ``tests/stress_dist.py -- -k "ends_the_other and
    stalled"``)."""
    shm_dir = Path("/dev/shm") / f"layerwise-test-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()
    log0 = tmp_path / "kill.0.log"
    try:
        _lose_a_rank(tmp_path, shm_dir, lambda rank1: rank1.send_signal(sig),
                     lambda: log0.exists() and "step 3/" in log0.read_text(), shm_empty=True)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    report = RunDir.open(tmp_path / "run" / "ckpt").verify()
    assert report.ok and report.steps, report.to_json()
    resume_to = max(report.steps) + 1
    _run(tmp_path / "run", f"steps={resume_to}", "micro_batch_size=2", "export=false")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, resume_to + 1))


@pytest.mark.parametrize("killed", [True, pytest.param(False, marks=pytest.mark.sweep)],
                         ids=["killed", "stalled"])  # a stall's timeout: the lost-rank test has it
def test_a_rank_lost_in_its_blob_writes_leaves_the_last_commit(tmp_path, killed):
    """Rank 1 stops right after handing its first blob of the step-3 save to the run directory
    (``dist_child.stall_in_blob_writes``, armed once the step-2 save has finished; its marker
    says it stopped after step 2 was committed: in step 3's blobs, as rank 0 commits step 2
    before it sends step 3's choice) and is killed there (or left stalled), while rank 0 waits to
    gather the records: rank 0 exits with an error within ``dist_timeout_s``, the steps
    committed are exactly 1 and 2, rank 1's half-written save left a file of its own (mode
    0600) that no manifest names, ``ckpt verify`` is clean, and one process resumes from step 2.

    Mutations seen failing: ``saving.checkpointer`` making the exchange with a 30-minute timeout
    instead of ``dist_timeout_s`` (stalled: rank 0 waits at the gather past the test's limit);
    the fault armed on entry to ``save(3)`` without waiting for step 2's write, with rank 1's
    blob writes slowed by 0.3 s each so that step 2's is still running then (the stall lands in
    step 2's blobs: the marker's ``latest_committed`` is 1; unslowed, that race hit about one
    suite run in 200)."""
    shm_dir = Path("/dev/shm") / f"layerwise-test-{uuid.uuid4().hex[:8]}"
    shm_dir.mkdir()
    marker = tmp_path / "rank1-stalled"
    run = tmp_path / "run"
    try:
        _lose_a_rank(tmp_path, shm_dir, lambda rank1: rank1.kill() if killed else None,
                     marker.exists, {"rank": 1, "step": 3, "marker": str(marker)})
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert json.loads(marker.read_text()) == {"armed_at_save": 3, "latest_committed": 2}
    ckpt = run / "ckpt"
    report = RunDir.open(ckpt).verify()
    assert report.ok and report.steps == [1, 2], report.to_json()
    named = {e["blob"] for s in report.steps for e in json.loads(
        (ckpt / "steps" / f"{s:012d}" / "manifest.json").read_text())["groups"].values()}
    orphans = [p for p in [*(ckpt / "blobs").rglob("*"), *(ckpt / "tmp").iterdir()]
               if p.is_file() and str(p.relative_to(ckpt)) not in named]
    assert any(p.stat().st_mode & 0o777 == 0o644 & ~OTHER_UMASK for p in orphans), orphans
    _run(run, "steps=4", "micro_batch_size=2", "export=false")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
