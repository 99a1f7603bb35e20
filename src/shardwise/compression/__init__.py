"""Gradient compression: codecs and the one layer every strategy reduces compressed buckets through.

``CompressedComm`` (``compression.comm``) wraps a ``Comm`` and a ``Codec`` (``compression.codec``);
``build_compressed`` makes it from ``comm.compress = "NAME[:PARAM]"`` (``compression.spec``). The codecs:
identity and 16-bit casts (``cast``), int8 (``int8``), 1-bit signs (``sign``), top-k and DGC (``topk``),
PowerSGD (``powersgd``). This package sits below the engines: it knows ``Comm``, never a strategy.
"""

from shardwise.compression.codec import Codec, CodecState, MessageCodec, Reduced, Segment, segments_of
from shardwise.compression.comm import CompressedComm, CompressionStats
from shardwise.compression.spec import PARAMS, Spec, build_codec, build_compressed, check_compress, parse_spec

__all__ = [
    "PARAMS",
    "Codec",
    "CodecState",
    "CompressedComm",
    "CompressionStats",
    "MessageCodec",
    "Reduced",
    "Segment",
    "Spec",
    "build_codec",
    "build_compressed",
    "check_compress",
    "parse_spec",
    "segments_of",
]
