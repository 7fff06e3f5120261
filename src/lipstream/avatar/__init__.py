"""Avatars: action loops compiled once into everything the renderer needs that does not depend on audio."""

from lipstream.avatar.cache import Avatar, cycle_length, load_avatar, ping_pong
from lipstream.avatar.compile import CompileOptions, CompileResult, compile_avatar, compile_many

__all__ = ["Avatar", "CompileOptions", "CompileResult", "compile_avatar", "compile_many", "cycle_length",
           "load_avatar", "ping_pong"]
