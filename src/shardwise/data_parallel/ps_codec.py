"""The parameter server's traffic through the codec layer (``comm.compress``), in both directions.

Every message keeps the dense layout of :mod:`shardwise.data_parallel.ps_messages` on both ends; only
what travels changes. A message is ``[codec message (uint8) | small header]``: the tensor part goes
through ``CompressedComm.pack`` / ``unpack`` (so topk selects per parameter, int8 and sign chunks never
cross a parameter's edge: one ``Segment`` per parameter), the header travels uncompressed beside it, in
the parameters' dtype. Every byte goes through the wrapped ``Comm``, so ``CommStats`` counts it.

Pushes (worker w -> server s): the gradient shard, under error feedback kept by the worker, one
``CodecState`` per server shard; the header is the used flags, loss, version and kind. A parameter the
worker did not use this step is *held*: the server zeroes whatever the message says for it (its flag is
0) and the worker keeps its whole value in the residual, so nothing is lost and the server leaves it
alone, as without compression. "Done" and "pause" notices are packed without feedback (no state
changes). Async: a push the server refuses (staleness) is taken back with ``CompressedComm.undo``, so
the re-pushed, recomputed gradient neither loses nor double-counts the residual; so is the last push of
a batch given up.

Pulls (server s -> worker w): weights cannot be compressed under error feedback as they are (the error
would pile up in the weights), so the server sends the *update*: ``x = (weights now - weights at its
last pull message) + residual``, compressed, and the worker adds the decoded ``x`` to its copy of the
shard. Then ``worker copy + server residual == server weights`` at every step (to one rounding per
step): the worker lags by exactly what the server still holds back, and gets it in later pulls. The
server keeps one pull state per worker in async mode (each worker pulls when its own push is
answered), and one per shard in sync mode (every worker gets the same message: it is compressed once).
A lossless codec (``none``) sends the weights themselves: a delta added back would round, and ``none``
must give exactly what no codec gives. The weights at the start, at the end and on resume travel
uncompressed (the worker copies then equal the server's and the pull residuals restart at zero).

No communication here: the engine sends and receives what this module packs and unpacks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardwise.compression import CodecState, CompressedComm, segments_of
from shardwise.compression.codec import concat_bytes, split_bytes
from shardwise.data_parallel.ps_messages import KIND_GRAD, PUSH_EXTRA, REPLY_EXTRA, flatten
from shardwise.device import HOST

SYNC = -1  # the pull key of a synchronous server: one state for every worker


class PSCodec:
    """One rank's codec states for its parameter-server links: see the module docstring.

    ``shards[s]`` are the parameters server ``s`` holds (the same list on every rank).
    """

    def __init__(
        self, compressor: CompressedComm, shards: Sequence[Sequence[nn.Parameter]], dtype: torch.dtype
    ) -> None:
        self.compressor, self.shards, self.dtype = compressor, shards, dtype
        self.lossless_pulls = compressor.codec.lossless
        self.push: dict[int, CodecState] = {}  # worker: server -> this worker's push error feedback
        self.pulled: dict[int, torch.Tensor] = {}  # worker: server -> the shard's weights it holds (flat)
        self.pull: dict[int, CodecState] = {}  # server: worker (or SYNC) -> pull error feedback
        self.base: dict[int, torch.Tensor] = {}  # server: worker (or SYNC) -> weights at its last pull
        self._decoders: dict[tuple[str, int], CodecState] = {}  # receive side: layouts and caches only
        self._layouts: dict[int, CodecState] = {}  # server -> a state read only for sizes and layout

    def new_state(self, s: int) -> CodecState:
        """A codec state laid out as server ``s``'s shard, one segment per parameter."""
        shapes = [tuple(p.shape) for p in self.shards[s]]
        return self.compressor.new_state(self._numel(s), self.dtype, segments_of(shapes))

    def _layout(self, s: int) -> CodecState:
        """Server ``s``'s bucket layout (message sizes, notices), made once: no error feedback in it."""
        if s not in self._layouts:
            self._layouts[s] = self.new_state(s)
        return self._layouts[s]

    def _numel(self, s: int) -> int:
        return sum(p.numel() for p in self.shards[s])

    def _decoder(self, direction: str, peer: int, s: int) -> CodecState:
        """The receiving side's state for ``peer``'s messages (one per peer: listener threads share none)."""
        key = (direction, peer)
        if key not in self._decoders:
            self._decoders[key] = self.new_state(s)
        return self._decoders[key]

    def _header_bytes(self, count: int) -> int:
        return count * self.dtype.itemsize

    # -- pushes ------------------------------------------------------------------------------------
    def push_bytes(self, s: int) -> int:
        """The size of every message to server ``s`` (the server preallocates it)."""
        header = len(self.shards[s]) + PUSH_EXTRA
        return self.compressor.packed_bytes(self._layout(s)) + self._header_bytes(header)

    def push_state(self, s: int) -> CodecState:
        """This worker's push error feedback for server ``s`` (made on first use)."""
        if s not in self.push:
            self.push[s] = self.new_state(s)
        return self.push[s]

    def encode_push(self, s: int, dense: torch.Tensor) -> torch.Tensor:
        """A dense push for server ``s`` (``ps_messages.pack_push`` and its header) as its message."""
        n, params = self._numel(s), self.shards[s]
        grads, header = dense[:n], dense[n:]
        if header[-1] != KIND_GRAD:  # a notice: its gradient part is empty, no error feedback moves
            return concat_bytes(self.compressor.pack(grads, self._layout(s), feedback=False), header)
        state = self.push_state(s)
        hold = [
            (seg.offset, seg.offset + seg.numel)
            for seg, used in zip(state.segments, header[: len(params)].tolist(), strict=True)
            if used == 0
        ]
        return concat_bytes(self.compressor.pack(grads, state, hold=hold), header)

    def undo_push(self, s: int) -> None:
        """The last push to server ``s`` was refused or given up: its error feedback is taken back."""
        if s in self.push:
            self.compressor.undo(self.push[s])

    def decode_push(self, worker: int, s: int, wire: torch.Tensor) -> torch.Tensor:
        """Server ``s``: a worker's message back to the dense push, unused parameters' gradients zero."""
        state = self._decoder("push", worker, s)
        count = len(self.shards[s])
        data, header = _split(wire, self.compressor.packed_bytes(state), count + PUSH_EXTRA, self.dtype)
        grads = self.compressor.unpack(data, state)
        for seg, used in zip(state.segments, header[:count].tolist(), strict=True):
            if used == 0:
                grads[seg.offset : seg.offset + seg.numel] = 0
        return torch.cat([grads, header])

    # -- pulls -------------------------------------------------------------------------------------
    def reply_bytes(self, s: int) -> int:
        return self.compressor.packed_bytes(self._layout(s)) + self._header_bytes(REPLY_EXTRA)

    def start_pulls(self, s: int, keys: Sequence[int]) -> None:
        """Server ``s``: every worker (``keys``) holds the shard as it is now; no pull residual."""
        shard = list(self.shards[s])
        weights = flatten(shard, 0) if shard else torch.zeros(0, dtype=self.dtype, device=HOST)
        self.pull = {key: self.new_state(s) for key in keys}
        self.base = {key: weights.clone() for key in keys}

    def hold_pulled(self) -> None:
        """Worker: its copy of every shard is the model's weights now (after the start or a load)."""
        for s, params in enumerate(self.shards):
            if params:
                self.pulled[s] = flatten(list(params), 0)

    def encode_reply(self, key: int, dense: torch.Tensor, s: int) -> torch.Tensor:
        """Server ``s``: a dense reply (``reply_message``) as the message for ``key`` (a worker, or SYNC)."""
        n = self._numel(s)
        weights, header = dense[:n], dense[n:]
        if self.lossless_pulls:
            return concat_bytes(self.compressor.pack(weights, self.pull[key]), header)
        update = weights - self.base[key]
        self.base[key] = weights.clone()
        return concat_bytes(self.compressor.pack(update, self.pull[key]), header)

    def decode_reply(self, s: int, wire: torch.Tensor) -> torch.Tensor:
        """Worker: server ``s``'s message applied to this worker's copy, as a dense reply."""
        state = self._decoder("pull", s, s)
        data, header = _split(wire, self.compressor.packed_bytes(state), REPLY_EXTRA, self.dtype)
        decoded = self.compressor.unpack(data, state)
        if self.lossless_pulls or s not in self.pulled:
            self.pulled[s] = decoded
        else:
            self.pulled[s] = self.pulled[s] + decoded
        return torch.cat([self.pulled[s], header])


def _split(
    wire: torch.Tensor, data_bytes: int, header: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A message's codec part (uint8) and its header (``header`` values of ``dtype``)."""
    data, values = split_bytes(wire, (data_bytes, torch.uint8), (header, dtype))
    return data, values
