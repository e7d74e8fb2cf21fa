"""What proposes tokens for the target model to verify: an early exit of the model itself
(``early_exit``, with the exit heads of ``exit_heads``), a second model (``companion``), and the
trained multi-token heads of the tree methods (``medusa_transfer``: Medusa heads, Hidden Transfer
projections).  Drafters build on ``layerleap.core`` only; the methods in ``layerleap.methods`` use them."""
