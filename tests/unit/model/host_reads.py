"""Counting the operations that would make the host wait for a GPU.

On CPU nothing waits, so a test counts what would: Python reading tensor values
(`.tolist()`, `.item()`, `int()`/`bool()` of a tensor, `.cpu()`, `.numpy()`) and torch
operators whose output shape depends on tensor values (they copy a count to the host on CUDA).
tests/gpu checks the same forward with CUDA's own sync debug mode.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_VALUE_SHAPED = {
    aten._local_scalar_dense.default,  # .item(), int(t), bool(t)
    aten.nonzero.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,  # without output_size
}
_METHODS = ("tolist", "cpu", "numpy")


class HostReads(TorchDispatchMode):
    """`with HostReads() as r: ...` then `r.count` (and `r.where` for a failing test's message)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: list[str] = []
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_SHAPED and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            self._note(str(func))
        elif func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._note("boolean index")
        return func(*args, **kwargs)

    def _note(self, what: str) -> None:
        self.count += 1
        self.where.append(what)

    def __enter__(self):
        for name in _METHODS:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def counted(t, *a, _real=real, _name=name, **k):
                self._note(_name)
                return _real(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)
