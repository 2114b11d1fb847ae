"""Heterogeneous transformers (Nemotron-NAS / Llama-Nemotron): every layer's attention and MLP described by a
per-block JSON config (:mod:`.heterogeneous_config`), and the linear layers that replace a block
(:mod:`.linear_replacements`)."""
