"""Training the drafters' weights: exit heads (``exit_heads``), BiLD's prediction alignment
(``align``), Medusa heads and Hidden Transfer projections (``medusa_transfer``), and the SkipDecode
fine-tune (``skipdecode``).  Run from the ``layerleap train``, ``align`` and ``skipdecode`` commands."""
