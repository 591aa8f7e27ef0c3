"""``sink.protocols``: the seed's import path of the sink/source protocols; a thin re-export of
:mod:`sink.contract.protocols`.

Code inside the project imports :mod:`sink.contract.protocols`; this path is for users of the seed API."""

from __future__ import annotations

from sink.contract.protocols import (
    AsyncStagingSink,
    AsyncStagingSource,
    StagingSink,
    StagingSource,
)

__all__ = (
    "AsyncStagingSink",
    "AsyncStagingSource",
    "StagingSink",
    "StagingSource",
)
