"""``sink.digest``: the seed's import path of the digests; a thin re-export of :mod:`sink.contract.digest`.

Code inside the project imports :mod:`sink.contract.digest`; this path is for users of the seed API."""

from __future__ import annotations

from sink.contract.digest import (
    CALL_DIGEST_DOMAIN,
    CHAIN_HASH_DOMAIN,
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_DOMAIN,
    EXTRAS_DIGEST_VERSION,
    PREFIX_HASH_DOMAIN,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    build_staging_delta,
    chain_hash_of_packed,
    check_mask_values,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    digest_scalar_parts,
    encode_f32s,
    encode_token_ids,
    hash_packed_token_ids,
    hash_token_ids,
    is_digest_hex,
    is_token_id_list,
    staging_digest_from_packed,
)

__all__ = (
    "CALL_DIGEST_DOMAIN",
    "CHAIN_HASH_DOMAIN",
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_DOMAIN",
    "EXTRAS_DIGEST_VERSION",
    "PREFIX_HASH_DOMAIN",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "build_staging_delta",
    "chain_hash_of_packed",
    "check_mask_values",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "digest_scalar_parts",
    "encode_f32s",
    "encode_token_ids",
    "hash_packed_token_ids",
    "hash_token_ids",
    "is_digest_hex",
    "is_token_id_list",
    "staging_digest_from_packed",
)
