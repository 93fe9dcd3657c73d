"""The torch DataLoader bridge: a reader's loader workers as DataLoader worker processes.

Each worker reads its own shards (mmpipe.data.shards splits them), so every sample is read
once; items come round-robin by worker, the same order as iterating the reader in-process.
torch is imported only when a DataLoader is really made (num_workers > 1).
"""

from __future__ import annotations

from typing import Any, Iterator

from mmpipe.data.reader import Reader


def _view(stream: Reader, records: bool) -> Any:
    """The stream as a torch IterableDataset (its class is made here so that torch is imported
    only when a DataLoader is used)."""
    from torch.utils.data import IterableDataset

    class View(IterableDataset):
        def __iter__(self):
            return stream.records() if records else iter(stream)

    return View()


def _identity(x: Any) -> Any:
    return x


def loader(stream: Reader, *, records: bool = False, prefetch_factor: int = 2) -> Iterator[Any]:
    """Iterate `stream` through a torch DataLoader with `stream.num_workers` processes.

    Each worker reads its own shards, so every sample is read once; items come round-robin
    by worker, the same order as iterating the stream in-process. Positions and drops are
    noted on `stream` here in the main process, so `stream.state_dict()` is the position of
    the last item handed out (not of what the workers prefetched).
    """
    if stream.num_workers <= 1 or stream.worker_id is not None:
        yield from (stream.records() if records else iter(stream))
        return
    from torch.utils.data import DataLoader

    stream.rewind()
    dl = DataLoader(_view(stream, records), batch_size=None, num_workers=stream.num_workers,
                    collate_fn=_identity, prefetch_factor=prefetch_factor)
    for item in dl:
        stream.note(item)
        yield item
