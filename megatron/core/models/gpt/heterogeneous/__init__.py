"""GPT layer specs of heterogeneous transformers (:mod:`.heterogeneous_layer_specs`)."""
