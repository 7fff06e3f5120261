"""Per-session live encoding: SessionEncoder in-process (lipstream.session_encoder, torch-free so an encode
worker can import it) or EncodePool's sessions in worker processes (encode_pool.py), off the engine's GIL."""

from lipstream.live.encode_pool import EncodePool, PoolEncoder
from lipstream.session_encoder import EncodedPacket, SessionEncoder

__all__ = ["EncodePool", "EncodedPacket", "PoolEncoder", "SessionEncoder"]
