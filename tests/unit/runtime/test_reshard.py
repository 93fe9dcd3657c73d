"""Reading a checkpoint's optimizer state by parameter name (runtime/reshard.py), on files laid
out as DeepSpeed 0.19.8 writes them: a ZeRO-1 parameter split over two replicas' partitions is
joined whole, and a ZeRO-0 FusedAdam state (which counts steps on a group's last parameter only)
gives every parameter the optimizer's step count."""

from __future__ import annotations

import json

import torch
from deepspeed.utils.tensor_fragment import fragment_address

from mmpipe.runtime.reshard import model_file, order_file, read_states, zero_file

COUNTERS = {"lr_scheduler": {}, "global_steps": 5, "global_samples": 40, "skipped_steps": 0, "step": 5}


def _load(path: str):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_zero1_pieces_are_joined_in_replica_order(tmp_path):
    a, b = torch.arange(6.0), torch.arange(10.0, 14.0)  # "0.w" (6) and "1.w" (4): 10 values, 5 per replica
    flat = torch.cat([a, b])
    torch.save(COUNTERS | {"optimizer": None}, tmp_path / model_file(0))
    for d in range(2):
        part = flat[5 * d:5 * d + 5]
        mapping = ({"0.w": fragment_address(numel=5, start=0)} if d == 0 else
                   {"0.w": fragment_address(numel=1, start=0), "1.w": fragment_address(numel=4, start=1)})
        state = {"step": torch.tensor(5.0), "exp_avg": part * 2, "exp_avg_sq": part * 3}
        osd = {"base_optimizer_state": {"state": {0: state}, "param_groups": [{"lr": 1.0, "params": [0]}]},
               "single_partition_of_fp32_groups": [part], "param_slice_mappings": [mapping]}
        torch.save({"optimizer_state_dict": osd}, tmp_path / zero_file(0, d, "fp32"))
    got = read_states(tmp_path, {"pp": 1, "dp": 2, "zero": 1, "precision": "fp32"}, {"0.w", "1.w"}, _load)
    assert torch.equal(got.masters["0.w"], a) and torch.equal(got.masters["1.w"], b)
    assert torch.equal(got.states["0.w"]["exp_avg"], a * 2) and torch.equal(got.states["1.w"]["exp_avg_sq"], b * 3)
    assert float(got.states["1.w"]["step"]) == 5.0 and got.hyper == {"lr": 1.0}
    assert got.known == {"0.w", "1.w"} and got.counters["global_steps"] == 5


def test_zero0_fused_adam_step_count_reaches_every_parameter(tmp_path):
    opt = {"state": {0: {"step": 0, "exp_avg": torch.ones(2)}, 1: {"step": 7, "exp_avg": torch.ones(3)}},
           "param_groups": [{"lr": 1.0, "params": [0, 1]}]}
    torch.save(COUNTERS | {"optimizer": opt}, tmp_path / model_file(0))
    (tmp_path / order_file(0)).write_text(json.dumps(["0.w", "1.w"]))
    got = read_states(tmp_path, {"pp": 1, "dp": 1, "zero": 0}, {"0.w", "1.w"}, _load)
    assert [got.states[n]["step"] for n in ("0.w", "1.w")] == [7, 7]
