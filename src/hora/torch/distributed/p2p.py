"""``send`` and ``recv`` of hora's process group: torch's point-to-point calls as hora's
tagged messages (:mod:`hora.frameworks.p2p`), which travel beside the engine on connections of
their own.

A message matches a receive by sender, group and tag, in the order sent. A send's ``Work``
completes when the receiver has taken the message; a receive of another dtype or size fails
on both ranks naming both; a peer that dies fails both within seconds. Called from
:class:`~hora.torch.distributed.group.HoraProcessGroup` in the caller's thread; results land
in the receiving tensor from the mailbox's reader thread.
"""

from __future__ import annotations

from typing import Any

import torch

from hora.frameworks import p2p
from hora.torch.adapter import _numpy, check_tensor
from hora.torch.distributed.work import HoraWork


class HostBuffer:
    """A tensor's data in host memory as the op surface takes it: a view of a contiguous CPU
    tensor, else a contiguous host copy (a CUDA tensor's: these calls move it through host
    memory, whichever backend the job runs); ``write_back`` puts a received result back."""

    def __init__(self, tensor: torch.Tensor) -> None:
        check_tensor(tensor)
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")
        host = host.contiguous().resolve_conj().resolve_neg()
        self.tensor, self.host = tensor, host
        self.array, self.dtype = _numpy(host)

    def write_back(self) -> None:
        if self.host.data_ptr() != self.tensor.data_ptr() or self.tensor.device.type != "cpu":
            self.tensor.data.copy_(self.host.view(self.tensor.shape))


def _peer(group: Any, tensors: list[torch.Tensor], peer: int | None, call: str) -> int | None:
    """The global rank of group rank ``peer`` (None: any rank) of a call on one tensor."""
    if len(tensors) != 1:
        raise ValueError(f"hora backend: {call} takes one tensor, got {len(tensors)}")
    if peer is None:
        return None
    if not 0 <= int(peer) < group.size():
        raise ValueError(f"hora backend: {call}: rank {peer} is not a rank of a group of "
                         f"{group.size()}")  # fmt: skip
    return int(group._ranks[int(peer)])


def send(group: Any, tensors: list[torch.Tensor], dst: int, tag: int) -> HoraWork:
    peer = _peer(group, tensors, dst, "send")
    s = HostBuffer(tensors[0])

    def start() -> list[Any]:
        return [p2p.send_async(s.array, peer, tag=tag, process_set=group._set, dtype=s.dtype)]

    return group._work("send", list(tensors), start)  # type: ignore[no-any-return]


def recv(group: Any, tensors: list[torch.Tensor], src: int | None, tag: int) -> HoraWork:
    """``src`` None: from any rank of the group (torch's ``recv_anysource``); the work's
    ``_source_rank()`` gives the sender's group rank, as torch's ``recv`` asks of it."""
    peer = _peer(group, tensors, src, "recv")
    s = HostBuffer(tensors[0])
    sender: list[int] = []

    def start() -> list[Any]:
        return [p2p.recv_async(s.array, peer, tag=tag, process_set=group._set, dtype=s.dtype)]

    def finish(results: list[Any]) -> None:
        s.write_back()
        sender.append(group._ranks.index(int(results[0])))

    work: HoraWork = group._work("recv", list(tensors), start, finish)
    work.source = sender
    return work
