"""``CompressedComm``: the one codec layer every strategy reduces compressed gradients through.

It wraps a ``Comm`` (so every byte goes through ``CommStats``) and one ``Codec``, and runs each
reduction the same way whatever the codec or the caller (DDP buckets, ZeRO flat groups, DiLoCo's
pseudo-gradient, parameter-server pushes):

1. ``prepare`` (DGC's clipping and momentum; the gradient itself for other codecs);
2. error feedback: the bucket's residual from earlier steps is added (``x = g + residual``);
3. the codec's rounds: encode, exchange (the collective it chooses), decode and combine into the sum
   over ranks, identical on every rank;
4. the residual becomes ``x - sent`` (what this rank's message left out) and the bucket is overwritten
   with the sum. Ranges of the bucket outside every tensor (ZeRO's padding) stay zero.

Error feedback as in Seide et al., "1-Bit Stochastic Gradient Descent" (Interspeech 2014) and
Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes" (ICML 2019).

So for every rank and every step ``sent + new residual == g + old residual``, and over any number of
steps the messages a rank sent plus its residual add up to the gradients it was given (exactly, up to
the one rounding of ``x - sent``). The first ``start_step`` reductions of each bucket go through the
identity codec (no residual: PyTorch PowerSGD's ``start_powerSGD_iter``). Lossless codecs keep no
residual (it would always be zero).

Communication: whatever the codec's rounds issue on the wrapped ``Comm``; with ``async_op=True`` the
first round is launched before ``reduce`` returns and the rest runs in ``wait()``, so it overlaps the
caller's work (DDP: the rest of backward). Every rank must reduce its buckets in the same order, as with
any collective. Point to point (``pack``/``unpack``): a self-contained message for one receiver, which
decodes each sender's message by itself (the parameter server: ``data_parallel.ps_codec``, pushes
and pulls); ``hold`` marks ranges the receiver drops (unused parameters: their residual keeps them)
and ``undo`` takes back a refused message's feedback. No collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardwise.collectives.api import Comm
from shardwise.compression.cast import IdentityCodec
from shardwise.compression.codec import Codec, CodecState, Reduced, Rounds, Segment, gaps_of


@dataclass
class CompressionStats:
    """What this rank reduced and what it put on the wire (the exact bytes are the ``Comm``'s)."""

    reductions: int = 0
    raw_bytes: int = 0  # bytes of the buckets reduced (what an uncompressed message would carry)


class CompressedComm:
    """Reductions of flat buckets over ``comm`` through ``codec``, with per-bucket error feedback."""

    def __init__(self, comm: Comm, codec: Codec, start_step: int = 0) -> None:
        self.comm, self.codec, self.start_step = comm, codec, start_step
        self.plain = IdentityCodec("none")  # the uncompressed warm-up (start_step)
        self.stats = CompressionStats()

    @property
    def name(self) -> str:
        return self.codec.name

    def new_state(
        self, numel: int, dtype: torch.dtype, segments: Sequence[Segment] | None = None
    ) -> CodecState:
        """The state of one bucket of ``numel`` elements laid out as ``segments`` (default: one tensor)."""
        segs = tuple(segments) if segments is not None else (Segment(0, (numel,)),)
        return CodecState(numel, dtype, segs, gaps_of(numel, segs))

    def codec_for(self, state: CodecState) -> Codec:
        """The codec of this reduction: the identity during the first ``start_step`` ones."""
        return self.plain if state.reductions < self.start_step else self.codec

    # -- collective reductions -------------------------------------------------------------------------
    def reduce(self, bucket: torch.Tensor, state: CodecState, async_op: bool = False) -> _Reduction:
        """Overwrite ``bucket`` (numel,), this rank's share, with the sum over ranks; see the module
        docstring. With ``async_op`` the returned work must be waited for before reading ``bucket``."""
        if bucket.numel() != state.numel:
            raise ValueError(
                f"a bucket of {bucket.numel()} elements, but its state was made for {state.numel}"
            )
        codec = self.codec_for(state)
        x = self._corrected(codec, bucket, state)
        pending = _Reduction(self, codec, bucket, state, x, codec.rounds(x, state, self.comm))
        if not async_op:
            pending.wait()
        return pending

    def _corrected(self, codec: Codec, bucket: torch.Tensor, state: CodecState) -> torch.Tensor:
        """``prepare(g) + residual``, a new tensor (the codec may write into it)."""
        wanted = codec.prepare(bucket, state, self.comm)
        if state.residual is not None and not codec.lossless:
            return wanted + state.residual
        return wanted.clone()

    def _finish(self, codec: Codec, state: CodecState, x: torch.Tensor, sent: torch.Tensor) -> None:
        """Error feedback: keep what this rank's message left out of ``x``."""
        state.reductions += 1
        self.stats.reductions += 1
        self.stats.raw_bytes += x.numel() * x.element_size()
        if codec.lossless:
            return
        residual = x - sent
        for a, b in state.gaps:
            residual[a:b] = 0
        # an overflow (fp16 loss scaling, say) would poison every later step: start afresh (decided
        # where the residual is, without reading it on the host)
        residual.masked_fill_(~torch.isfinite(residual).all(), 0.0)
        state.residual = residual

    # -- point to point (parameter-server pushes) ------------------------------------------------------
    def pack(
        self,
        bucket: torch.Tensor,
        state: CodecState,
        feedback: bool = True,
        hold: Sequence[tuple[int, int]] = (),
    ) -> torch.Tensor:
        """One self-contained message (uint8) for ``bucket``, laid out as ``state``: under error
        feedback, or (``feedback=False``) a message that changes no state, e.g. a "done" notice.

        ``hold``: ``[a, b)`` ranges the receiver will drop (a parameter server's unused parameters):
        whatever the message says there counts as not sent, so their residual keeps all of ``x``."""
        codec = self.codec_for(state)
        self._require_pushable(codec)
        if not feedback:
            scratch = CodecState(state.numel, state.dtype, state.segments, state.gaps)
            return codec.pack(bucket, scratch)[0]
        previous = state.residual
        x = self._corrected(codec, bucket, state)
        data, sent = codec.pack(x, state)
        if hold:
            sent = sent.clone()  # it may share memory with the message (a cast to the bucket's dtype)
            for a, b in hold:
                sent[a:b] = 0
        self._finish(codec, state, x, sent)
        state.previous, state.undoable = previous, True
        return data

    def undo(self, state: CodecState) -> None:
        """Forget the last ``pack`` of ``state``: its message was refused (an asynchronous server).
        A second call, or one after no pack, does nothing."""
        if state.undoable:
            state.residual, state.previous, state.undoable = state.previous, None, False
            state.reductions -= 1

    def packed_bytes(self, state: CodecState) -> int:
        """The size of the messages ``pack`` makes for the bucket of ``state`` (a receiver preallocates)."""
        self._require_pushable(self.codec)
        if self.start_step:
            raise ValueError("point-to-point messages need comm.compress_start_step = 0 (a fixed size)")
        return self.codec.packed_bytes(state)

    def unpack(self, data: torch.Tensor, state: CodecState) -> torch.Tensor:
        """A message ``pack`` made for a bucket laid out as ``state``, decoded to the dense (numel,)
        tensor it stands for (the receiver's state: no error feedback on this side)."""
        return self.codec.unpack(data, state)

    def _require_pushable(self, codec: Codec) -> None:
        if not codec.pushable or not codec.fixed_size:
            why = "it has no single-message form" if not codec.pushable else "its message size changes"
            raise ValueError(f"the {codec.name} codec cannot compress point-to-point messages: {why}")


class _Reduction:
    """A reduction in flight: the codec's rounds, resumed as each round's collective completes."""

    def __init__(
        self, owner: CompressedComm, codec: Codec, bucket: torch.Tensor, state: CodecState, x: torch.Tensor,
        rounds: Rounds,
    ) -> None:  # fmt: skip
        self._owner, self._codec, self._bucket, self._state, self._x = owner, codec, bucket, state, x
        self._rounds: Rounds | None = rounds
        self._work = next(rounds)  # the first round's collective is under way from here on
        self.result: Reduced | None = None

    def wait(self) -> bool:
        while self._rounds is not None:
            self._work.wait()
            try:
                self._work = self._rounds.send(None)
            except StopIteration as stop:
                self._rounds = None
                self._complete(stop.value)
        return True

    def _complete(self, result: Reduced) -> None:
        self.result = result
        total = result.total
        for a, b in self._state.gaps:
            total[a:b] = 0
        self._bucket.copy_(total)
        self._owner._finish(self._codec, self._state, self._x, result.sent)
