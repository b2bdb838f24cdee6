"""Planning tools: the scale model (:mod:`.scale_model`: step time and
memory of a layout, measured or predicted) and, in :mod:`megatronapp.memory.plan`,
the memory planner."""
