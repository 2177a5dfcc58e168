"""A small MLP action-chunk policy (normalised state -> action chunk, MSE): the second policy behind
``policies.factory``, proof that a policy plugs in without touching ``fleet/`` or ``scripts/``."""

from policies.mlp_chunk.modeling_mlp_chunk import MLPChunkConfig, MLPChunkPolicy

__all__ = ["MLPChunkConfig", "MLPChunkPolicy"]
