"""A real DeepSpeed PipelineEngine in the test process (one stage, one rank, gloo): what the
runtime reads from an engine and how it saves through one, without launching processes."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def make_engine():
    """`make_engine(config)`: a one-stage PipelineEngine of two Linear layers, built by
    deepspeed.initialize with `config` (DeepSpeed JSON) and mmpipe's own AdamW (`make_optimizer`), as
    mmpipe's ranks build theirs. The process group lives for the test module."""
    import torch.distributed as dist

    from mmpipe.runtime.launch import free_port

    port = free_port()
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")  # as the launcher sets it for its ranks
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # DeepSpeed reads them; put back after the module (RANK makes mmpipe train run in place)
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from mmpipe.runtime.pipeline import make_optimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)

    def make(config: dict):
        torch.manual_seed(0)
        module = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 4)],
                                num_stages=1, loss_fn=torch.nn.MSELoss())
        optimizer = make_optimizer(module.parameters(), lr=1e-3, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                          config={"steps_per_print": 10**9, **config})
        return engine, optimizer

    yield make
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
