"""Checkpoint pieces that need no processes: records, safe loading, the LR schedule, RNG."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from mmpipe.runtime.checkpoint import (
    CheckpointError,
    SafeCheckpointEngine,
    commit,
    continue_schedule,
    find_checkpoint,
    first_nonfinite,
    refuse_other_history,
    rng_state,
    set_rng_state,
    sha256_of,
    truncate_records,
)
from mmpipe.runtime.pipeline import lr_lambda


def test_records_keep_the_steps_up_to_the_resumed_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(lines) + '\n{"step": 5, "lo')  # the last line cut by a kill
    truncate_records(path, 2)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    truncate_records(path, 0)  # a fresh run in the same directory starts the record afresh
    assert path.read_text() == ""
    truncate_records(tmp_path / "absent.jsonl", 3)
    assert not (tmp_path / "absent.jsonl").exists()


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_a_file_that_would_run_code_is_refused_naming_it(tmp_path):
    evil = _RunsCode()
    evil.flag = tmp_path / "ran"
    path = tmp_path / "layer_03-model_states.pt"
    torch.save({"weight": torch.ones(2), "x": evil}, path)
    engine = SafeCheckpointEngine(zipfile_serialization=True, trusted=False)
    with pytest.raises(CheckpointError) as err:
        engine.load(str(path))
    assert str(err.value).startswith(f"{path} holds a Python object (posix.system)")
    assert "train.resume_unsafe=true" in str(err.value)
    assert not evil.flag.exists()
    plain = tmp_path / "plain.pt"
    torch.save({"weight": torch.arange(3.0), "step": 4, "groups": [{"lr": 0.1}]}, plain)
    assert engine.load(str(plain))["weight"].tolist() == [0.0, 1.0, 2.0]


def test_an_unreadable_file_is_named(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"weight": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(CheckpointError, match=f"cannot read checkpoint file {path}: "):
        SafeCheckpointEngine(zipfile_serialization=True, trusted=False).load(str(path))


def _scheduler(total: int, peak: float = 1e-3):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup=3, total=total))


def _step(sched) -> float:
    lr = sched.get_last_lr()[0]  # the rate a step trains with, as train.py logs it
    sched.optimizer.step()
    sched.step()
    return lr


def test_the_schedule_continues_from_the_step():
    whole = _scheduler(10)
    want = [_step(whole) for _ in range(10)]
    first = _scheduler(10)
    got = [_step(first) for _ in range(4)]
    again = _scheduler(10)
    again.load_state_dict(first.state_dict())  # what DeepSpeed restores
    continue_schedule(again, 4, peak=1e-3)
    got += [_step(again) for _ in range(6)]
    assert got == want
    # With a longer run the first resumed step already trains on the new cosine, not on the
    # rate the saved schedule left behind (that was the jump in the logged lr).
    longer = _scheduler(15)
    longer.load_state_dict(first.state_dict())
    assert continue_schedule(longer, 4, peak=1e-3) == pytest.approx(1e-3 * lr_lambda(4, warmup=3, total=15))
    higher = _scheduler(10, peak=2e-3)  # train.lr changed too: the new peak, not the saved one
    higher.load_state_dict(first.state_dict())
    assert continue_schedule(higher, 4, peak=2e-3) == pytest.approx(2e-3 * lr_lambda(4, warmup=3, total=10))


def test_rng_state_survives_a_safe_round_trip(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and (got[1] == want[1]).all() and got[2] == want[2]


# -- finding a checkpoint: rank 0's choice and the file checks, in a one-rank process group --

TOPOLOGY = {"pp": 1, "dp": 1, "stages": [[0, 15]], "precision": "fp32", "zero": 0}
SCHEDULE = {"lr": 3e-3, "warmup_steps": 5, "steps": 10}


@pytest.fixture(scope="module")
def one_rank():
    import torch.distributed as dist

    from mmpipe.runtime.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _checkpoint(run_dir, step, *, committed=True, topology=TOPOLOGY):
    folder = run_dir / "checkpoints" / f"step{step}"
    folder.mkdir(parents=True)
    ranks = [f"rng_rank{r}.pt" for r in range(topology["pp"] * topology["dp"])]
    for name in (*ranks, "data_state_dp0.json", "mp_rank_00_model_states.pt"):
        (folder / name).write_bytes(os.urandom(100))
    if committed:
        files = {p.name: dict(zip(("size", "sha256"), sha256_of(p))) for p in sorted(folder.iterdir())}
        commit(folder, step=step, files=files, topology=topology, schedule=SCHEDULE)
    return folder


def _find(target, run_dir, topology=TOPOLOGY, steps=10):
    return find_checkpoint(target, given=str(target), run_dir=run_dir, topology=topology, steps=steps)


def test_the_newest_committed_checkpoint_is_chosen_and_unfinished_ones_are_named(one_rank, tmp_path, capsys):
    run = tmp_path / "run"
    _checkpoint(run, 2), _checkpoint(run, 4), _checkpoint(run, 6, committed=False)
    found = _find(run, tmp_path / "new")
    assert found.step == 4 and found.folder == run / "checkpoints" / "step4"
    skipped = f"warning: skipping {run}/checkpoints/step6: not committed (its save did not finish)\n"
    assert capsys.readouterr().err == skipped
    assert _find(run / "checkpoints", tmp_path / "new").step == 4
    assert _find(run / "checkpoints" / "step2", tmp_path / "new").step == 2


@pytest.mark.parametrize("case, message", [
    ("nothing committed", "no committed checkpoint in {run}/checkpoints (unfinished saves: step3); start without"),
    ("unfinished folder", "{run}/checkpoints/step3 is not a committed checkpoint (no committed.json"),
    ("damaged", "checkpoint {run}/checkpoints/step4 is damaged: data_state_dp0.json does not match its recorded "
                "sha256; mp_rank_00_model_states.pt has 7 bytes, 100 recorded; rng_rank0.pt is missing; restore "
                "these files or resume from an earlier one (train.resume={run}/checkpoints/step2)"),
    ("other stages", "the checkpoint's layout differs from this run's (pipeline pp=1 stages [[0, 15]] -> pp=2 "
                     "stages [[0, 11], [11, 15]]); the checkpoint lacks optimizer_params_stage0.json (written by "
                     "an earlier mmpipe), so its optimizer state cannot be remapped: resume with its layout"),
    ("other precision", "the checkpoint was written with train.precision=fp32; this run has train.precision=bf16; "
                        "resume with the same"),
    ("at the end", "the checkpoint is at step 4, not below train.steps=4; raise train.steps"),
    ("older, same run", "this run directory has newer checkpoints (step4); resuming step 2 here would mix two "
                        "histories"),
])
def test_unusable_checkpoints_are_one_line_errors(one_rank, tmp_path, case, message):
    run = tmp_path / "run"
    kwargs = {"run_dir": tmp_path / "new"}
    target = run
    if case in ("nothing committed", "unfinished folder"):
        _checkpoint(run, 3, committed=False)
        target = run / "checkpoints" / "step3" if case == "unfinished folder" else run
    else:
        _checkpoint(run, 2), _checkpoint(run, 4)
    if case == "damaged":
        (run / "checkpoints" / "step4" / "mp_rank_00_model_states.pt").write_bytes(b"trimmed")
        (run / "checkpoints" / "step4" / "rng_rank0.pt").unlink()
        (run / "checkpoints" / "step4" / "data_state_dp0.json").write_bytes(bytes(100))
    if case == "other stages":
        kwargs["topology"] = {**TOPOLOGY, "pp": 2, "stages": [[0, 11], [11, 15]]}
    if case == "other precision":
        kwargs["topology"] = {**TOPOLOGY, "precision": "bf16", "zero": 1}
    if case == "at the end":
        kwargs["steps"] = 4
    if case == "older, same run":
        target, kwargs["run_dir"] = run / "checkpoints" / "step2", run
    with pytest.raises(CheckpointError) as err:
        _find(target, **kwargs)
    assert message.format(run=run) in str(err.value)
    assert "\n" not in str(err.value)


def test_resuming_with_another_model_says_the_model_differs(one_rank, tmp_path, capsys):
    """Before launch (the CLI reads the commit record) and in the ranks alike: the figures that
    differ, not "stages differ ... use plan.stages"."""
    from mmpipe.cli import load, main
    from mmpipe.model.spec import model_identity

    tiny = model_identity(load([], job="test").model)
    run = tmp_path / "run"
    _checkpoint(run, 2, topology={**TOPOLOGY, "model": tiny})
    deeper = model_identity(load(["model.llm.blocks=6"], job="test").model)
    with pytest.raises(CheckpointError) as err:
        _find(run, tmp_path / "new", topology={**TOPOLOGY, "pp": 2, "stages": [[0, 11], [11, 17]], "model": deeper})
    want = (f"train.resume={run}: {run}/checkpoints/step2 holds model tiny, not this run's model tiny (llm.blocks: "
            f"4 in the checkpoint, 6 in this run); resume with the model it was trained with (its model=... and "
            f"model.* settings), or train this one without train.resume")
    assert str(err.value) == want
    assert main(["train", f"train.resume={run}", "model.llm.blocks=6", f"hydra.run.dir={tmp_path / 'new'}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"mmpipe train: error: {want}"
    assert not (tmp_path / "new").exists()
    # what shapes no tensor (the longest sample) resumes
    assert _find(run, tmp_path / "new", topology={**TOPOLOGY, "model": model_identity(
        load(["model.llm.max_seq_len=256"], job="test").model)}).step == 2


def test_another_replica_count_resumes_with_a_warning(one_rank, tmp_path, capsys):
    _checkpoint(tmp_path / "run", 2)
    found = _find(tmp_path / "run", tmp_path / "new", topology={**TOPOLOGY, "dp": 2})
    assert found.step == 2
    assert ("warning: parallel.dp=2 differs from the checkpoint's 1: the reader positions carry over exactly when "
            "every replica reads the one stream (plan.across_replicas=true), else each reader skips the samples the "
            "old replicas had taken") in \
        capsys.readouterr().err


def test_a_fresh_run_refuses_a_directory_with_another_runs_checkpoints(one_rank, tmp_path):
    refuse_other_history(tmp_path)  # nothing there
    _checkpoint(tmp_path, 1, committed=False)
    refuse_other_history(tmp_path)  # an unfinished save is no history
    _checkpoint(tmp_path, 2)
    with pytest.raises(CheckpointError, match=f"{tmp_path} already holds committed checkpoints of another run "
                                              f"\\(step2\\); continue it with train.resume={tmp_path}"):
        refuse_other_history(tmp_path)


def test_nonfinite_weights_or_moments_are_found():
    layer = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert first_nonfinite(layer, opt) is None
    next(iter(opt.state.values()))["exp_avg"][0] = float("nan")
    assert first_nonfinite(layer, opt) == "optimizer state exp_avg"
    with torch.no_grad():
        layer.bias[1] = float("inf")
    assert first_nonfinite(layer, opt) == "parameter bias"


def test_checkpoint_info_says_what_a_checkpoint_resumes_on(tmp_path, capsys):
    """`mmpipe checkpoint info`: the step, layout, precision and adapters, and the layouts: any pp,
    cut, dp and ZeRO stage when the optimizer state can be read by parameter (ZeRO-0 with the
    optimizer order recorded; ZeRO-1's per-replica files), its own layout only otherwise."""
    from mmpipe.cli import main
    from mmpipe.runtime.checkpoint import commit
    from mmpipe.runtime.reshard import order_file, zero_file

    def write(name, zero, orders, lora=None):
        folder = tmp_path / name / "checkpoints" / "step3"
        folder.mkdir(parents=True)
        names = [zero_file(s, d, "fp32") for s in range(2) for d in range(2)] if zero else map(order_file, range(2))
        files = {n: {"size": 10, "sha256": "x"} for n in names if orders}
        files["layer_00-model_states.pt"] = {"size": 2**20, "sha256": "x"}
        commit(folder, step=3, files=files, schedule={},
               topology={"pp": 2, "dp": 2, "stages": [[0, 9], [9, 15]], "precision": "fp32", "zero": zero,
                         "model": {"name": "tiny", "class": "mmpipe", "llm": {"blocks": 4}}, "lora": lora})
        return tmp_path / name

    assert main(["checkpoint", "info", str(write("a", 0, True, lora={"r": 8}))]) == 0
    out = capsys.readouterr().out
    assert "step 3, committed, 3 files, 1.0 MiB" in out
    assert "layout: parallel.pp=2 x parallel.dp=2, stages [[0, 9], [9, 15]]" in out
    assert "LoRA {'r': 8} (the frozen base weights are not in the files)" in out
    anywhere = "any parallel.pp, cut, parallel.dp and ZeRO stage the precision allows"
    assert anywhere in out
    assert main(["checkpoint", "info", str(write("b", 1, True))]) == 0
    out = capsys.readouterr().out
    assert "training: train.precision=fp32, ZeRO stage 1; no adapters" in out and anywhere in out
    for name, zero, lacks in (("c", 0, "optimizer_params_stage0.json"), ("d", 1, "zero_pp_rank_0_mp_rank_00")):
        assert main(["checkpoint", "info", str(write(name, zero, False))]) == 0
        out = capsys.readouterr().out
        assert f"; this layout only (the checkpoint lacks {lacks}" in out and anywhere not in out
    assert main(["checkpoint", "info", str(tmp_path / "none")]) == 2
    assert "no such folder; give a run directory" in capsys.readouterr().err
    # as a user runs it: on a machine with no GPU, DeepSpeed's import is told the accelerator
    # instead of warning that it could not detect one
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    shown = subprocess.run([sys.executable, "-m", "mmpipe", "checkpoint", "info", str(tmp_path / "a")], env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "step 3, committed" in shown.stdout, shown.stderr[-2000:]
    assert "Setting accelerator" not in shown.stdout + shown.stderr
    assert main(["checkpoint", "show", str(tmp_path)]) == 2


def test_a_changed_weight_decay_is_applied_over_the_loaded_optimizer_state():
    """The step a resumed AdamW takes with train.weight_decay=0.5 over a checkpoint saved with 0.0
    is the plain step minus lr * 0.5 * w (AdamW's decoupled decay), not the saved setting's step;
    through a wrapper as DeepSpeed's (`.optimizer`) too."""
    import copy
    from types import SimpleNamespace

    from mmpipe.runtime.checkpoint import apply_optimizer_settings

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8))

    def step(opt):
        opt.zero_grad()
        (w ** 2 * torch.arange(8.0)).sum().backward()
        opt.step()
        return w.detach().clone()

    saved_with = torch.optim.AdamW([w], lr=0.1, weight_decay=0.0)
    step(saved_with)
    saved, w0 = copy.deepcopy(saved_with.state_dict()), w.detach().clone()
    plain = step(saved_with)  # the next step with the checkpoint's setting
    w.data.copy_(w0)
    resumed = torch.optim.AdamW([w], lr=0.1, weight_decay=0.5)
    resumed.load_state_dict(saved)  # what DeepSpeed does: the saved weight_decay comes back
    wrapper = SimpleNamespace(optimizer=resumed, param_groups=[])
    assert apply_optimizer_settings(wrapper, {"weight_decay": 0.5}) == {"weight_decay": 0.0}
    assert apply_optimizer_settings(wrapper, {"weight_decay": 0.5}) == {}  # nothing left to change
    torch.testing.assert_close(step(resumed), plain - 0.1 * 0.5 * w0)


def test_a_resume_with_other_adapters_or_layers_is_refused_before_launch_without_torch(tmp_path):
    """Issue 34: a resume with another train.lora was refused only once the ranks had started
    (73 s), as a Python dict and Hydra's `Error executing job`. The command line applies the
    ranks' rules to the commit record: one line naming the settings that resume, no rank, and
    neither torch nor DeepSpeed imported (their import alone takes seconds)."""
    import subprocess
    import sys

    from mmpipe.cli import load
    from mmpipe.runtime.committed import run_topology

    run, new = tmp_path / "run", tmp_path / "new"
    rc = load([], job="test")
    _checkpoint(run, 2, topology=run_topology(rc, [[0, 8], [8, 15]]))
    script = ("import sys; from mmpipe.cli import main\n"
              f"codes = [main(['train', 'train.resume={run}', 'hydra.run.dir={new}', o]) for o in sys.argv[1:]]\n"
              "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules), codes)")
    done = subprocess.run([sys.executable, "-c", script, "train.lora.r=8", "train.trainable=[llm]"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[] [2, 2]", done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mmpipe train: error: train.resume={run}: this run asks for adapters (train.lora.r=8) but the checkpoint "
        f"trained none; resume with train.lora.r=0, or train adapters in a new run (no train.resume)",
        f"mmpipe train: error: train.resume={run}: train.trainable=[llm] differs from the checkpoint's [all]; resume "
        f"with train.trainable=[all]"]
    assert not new.exists()
