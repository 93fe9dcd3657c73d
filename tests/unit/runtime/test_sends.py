"""Pipeline sends that do not wait for the receiver (runtime/sends.py)."""

from __future__ import annotations

import pytest


def _send_then_meet(rank: int, port: int, wrapped: bool, out) -> None:
    """Rank 0 runs a send handler that sends to stage 1, then meets rank 1 at a barrier; rank 1
    posts its receive only after that barrier (a stage busy encoding when its neighbour sends)."""
    import datetime
    import os
    import types

    import deepspeed.comm
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.pipe import p2p

    from mmpipe.runtime.sends import nonblocking_sends

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    deepspeed.comm.init_distributed("gloo", auto_mpi_discovery=False, verbose=False,
                                    timeout=datetime.timedelta(seconds=3))
    p2p._grid = types.SimpleNamespace(stage_to_global=lambda stage_id: stage_id, get_stage_id=lambda: rank,
                                      pipe_parallel_size=2)
    try:
        if rank == 0:
            kept = []

            def handler(_eng, buffer_id):  # as DeepSpeed's _exec_send_activations calls it
                p2p.send(torch.full((4,), float(buffer_id)), 1)

            run = nonblocking_sends(handler, keep=lambda w, t: kept.append((w, t))) if wrapped else handler
            run(types.SimpleNamespace(module=torch.nn.Module()), buffer_id=7)  # a training engine
            dist.barrier()
            for w, _ in kept:
                w.wait()
            out.put(("sent", len(kept)))
        else:
            dist.barrier()
            x = torch.zeros(4)
            dist.recv(x, 0)
            out.put(("received", x.tolist()))
    except RuntimeError as err:  # the blocking send never returns: the barrier times out
        out.put(("stuck", str(err).splitlines()[0][:80]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrapped", [True, False], ids=["nested send handler", "DeepSpeed's blocking send"])
def test_a_sender_goes_on_while_its_receiver_is_busy(wrapped):
    """A stage's receive may come late (after its previous micro-batch, or tower work under the
    nested schedule); its upstream neighbour's SendActivation / SendGrad must not wait for it
    (nonblocking_sends), and the tensor still arrives. DeepSpeed's own handler deadlocks here."""
    import torch.multiprocessing as mp

    from mmpipe.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_send_then_meet, args=(r, port, wrapped, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = dict(out.get(timeout=5) for _ in procs)
    if wrapped:
        assert got == {"sent": 1, "received": [7.0] * 4}
    else:
        assert "stuck" in got
