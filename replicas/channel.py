"""The data channel between a replica and its rank 0: pyzmq PUSH/PULL sockets carrying msgpack.

Requests go in as `AddRequest`/`AbortRequest`; each processed batch comes back as one list of
`TokenOutput`s, sent as soon as the batch is processed (no batching delay).

Neither end sets a high-water mark on the outputs: a zmq PUSH blocks once it is reached, and rank 0's
send runs in the scheduler loop, which must never wait for a replica that is slow to read.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from tandem.scheduler.messages import SchedulerMsg, TokenOutput


@dataclass(frozen=True)
class ChannelAddress:
    requests: str  # the replica binds PUSH here; rank 0 connects PULL
    outputs: str  # rank 0 connects PUSH here; the replica binds PULL


class ReplicaChannel:
    """The replica's end: binds both sockets on its node and speaks asyncio."""

    def __init__(self, host: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        for sock in (self._push, self._pull):
            sock.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        req_port = self._push.bind_to_random_port(f"tcp://{host}")
        out_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = ChannelAddress(f"tcp://{host}:{req_port}", f"tcp://{host}:{out_port}")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[TokenOutput])

    async def send(self, msg: SchedulerMsg) -> None:
        await self._push.send(self._encoder.encode(msg))

    async def recv(self) -> list[TokenOutput]:
        return self._decoder.decode(await self._pull.recv())

    def close(self) -> None:
        self._push.close()
        self._pull.close()
        self._ctx.term()


class RankChannel:
    """Rank 0's end: blocking sockets used from the scheduler loop thread."""

    def __init__(self, address: ChannelAddress) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._push = self._ctx.socket(zmq.PUSH)
        for sock in (self._push, self._pull):
            sock.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._pull.connect(address.requests)
        self._push.connect(address.outputs)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(SchedulerMsg)

    def recv_all(self, timeout_ms: int) -> list[SchedulerMsg]:
        """Everything queued; if nothing is, wait up to `timeout_ms` for the first message."""
        msgs: list[SchedulerMsg] = []
        if timeout_ms > 0 and not self._pull.poll(timeout_ms):
            return msgs
        # Poll before each receive: this runs every step, mostly with nothing queued, and a poll that
        # says so costs a small fraction of the exception an empty non-blocking receive raises.
        while self._pull.poll(0):
            msgs.append(self._decoder.decode(self._pull.recv(zmq.NOBLOCK)))
        return msgs

    def send(self, outputs: list[TokenOutput]) -> None:
        self._push.send(self._encoder.encode(outputs))

    def close(self) -> None:
        self._push.close()
        self._pull.close()
        self._ctx.term()
