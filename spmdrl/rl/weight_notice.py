"""rollout.partial's notice under parallel.placement=async: "the weights of version v are coming".

Trainer rank 0 sends each rollout rank a one-number message right before it starts broadcasting version
v's weights (:func:`announce`); each rollout rank posts the receive before it starts generating
(:class:`Notice`), and its interruptible generation polls it between engine steps without blocking
(spmdrl.rollout.interruptible). When it has arrived the rollout rank joins the broadcast mid-generation;
when the generation finishes first, it waits for the notice and syncs as without partial rollouts. Either
way every rollout rank joins each version's broadcast exactly once, so the collective cannot deadlock.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

# Point-to-point tag of the notices: apart from the rows' sends (spmdrl.distributed.exchange, tag 0).
NOTICE_TAG = 4242


class Notice:
    """A rollout rank's posted receive of version ``version``'s notice from rank ``src``.

    Gloo's receive work reports completion only through a blocking ``wait`` (its ``is_completed`` stays
    False, and a ``wait`` with a timeout that expires fails the whole process group), so a helper thread
    waits and the poll reads a flag.
    """

    def __init__(self, version: int, src: int) -> None:
        self.version = version
        self.synced = False  # set by the caller once it ran the weight sync for this notice
        self._buf = torch.zeros(1, dtype=torch.long)
        work = dist.irecv(self._buf, src=src, tag=NOTICE_TAG)
        assert work is not None
        self._error: BaseException | None = None
        self._done = threading.Event()

        def wait_in_background() -> None:
            try:
                work.wait()
            except BaseException as e:  # re-raised by wait() on the calling thread
                self._error = e
            self._done.set()

        self._thread = threading.Thread(target=wait_in_background, name="weight-notice", daemon=True)
        self._thread.start()

    def arrived(self) -> bool:
        """Whether the notice is here; never blocks."""
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the notice is here (and check it names the version this rank expects)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if int(self._buf[0]) != self.version:
            raise RuntimeError(
                f"weight notice for version {int(self._buf[0])} while version {self.version} was expected: "
                "the trainer and rollout ranks are out of step"
            )


def announce(version: int, rollout_ranks: list[int]) -> list[dist.Work]:
    """On trainer rank 0, before it broadcasts version ``version``: a notice to every rollout rank. Wait
    on the returned handles after the broadcast (by then every rollout rank has received its notice)."""
    buf = torch.tensor([version], dtype=torch.long)
    works = [dist.isend(buf, dst=r, tag=NOTICE_TAG) for r in rollout_ranks]
    return [w for w in works if w is not None]
