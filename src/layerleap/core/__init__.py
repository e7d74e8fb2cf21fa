"""The model core: a layer-addressable transformer (``model``), its KV cache (``kv_cache``), loading
and quantised weights (``loading``, ``gguf_q4``, ``kernels``, ``native``), and what every decoding
method shares: the per-call ``Run`` context and method registry (``run``), token choice
(``sampling``), draft trees (``tree``) and the acceptance rules (``verify``).

The core knows no decoding method, drafter, trainer or experiment: it imports nothing from
``layerleap.methods``, ``drafters``, ``train`` or ``eval`` (tests/test_architecture.py checks)."""
