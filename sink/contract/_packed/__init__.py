"""Private fast path: packed binary columns (ids, masks, log-probs) proved and hashed without per-token objects.

The rest of :mod:`sink` imports only the names below, from here; the
package's modules are its own business.
"""

from __future__ import annotations

from sink.contract._packed.columns import PackedColumns, TrustedColumns
from sink.contract._packed.floats import (
    MASK_CODES,
    carry_log_probs_zero_plain,
    f32_exact,
    finite_lanes,
    mask_values_from_codes,
    pack_f32be,
)
from sink.contract._packed.ids import ID_TYPECODES, ids_from_marshal, ids_u64be, is_token_id_list, pack_ids
from sink.contract._packed.lanes import Buffers, unpack_list
from sink.contract._packed.record_columns import (
    pack_validated_columns,
    prove_stored_columns,
    staging_delta_columns,
    trusted_components,
)

__all__ = (
    "ID_TYPECODES",
    "MASK_CODES",
    "Buffers",
    "PackedColumns",
    "TrustedColumns",
    "carry_log_probs_zero_plain",
    "f32_exact",
    "finite_lanes",
    "ids_from_marshal",
    "ids_u64be",
    "is_token_id_list",
    "mask_values_from_codes",
    "pack_f32be",
    "pack_ids",
    "pack_validated_columns",
    "prove_stored_columns",
    "staging_delta_columns",
    "trusted_components",
    "unpack_list",
)
