"""The small Llama under its first documented import path; it lives in
:mod:`shardckpt.runtime.models.llama`."""

from __future__ import annotations

from shardckpt.runtime.models.llama import *  # noqa: F401,F403
from shardckpt.runtime.models.llama import __all__  # noqa: F401
