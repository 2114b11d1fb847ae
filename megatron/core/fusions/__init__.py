"""The fused element-wise kernels, one module each (megatron-core's import paths):

* ``fused_kernels`` — the compile rule (:func:`compile_blocker`), :func:`log_once`, and the ``torch.compile``d
  RMSNorm / LayerNorm / bias-SwiGLU / RoPE ops (:class:`FusedOp`);
* ``fused_bias_gelu``, ``fused_bias_dropout``, ``fused_softmax``, ``fused_cross_entropy``;
* ``fused_layer_norm`` — megatron-core's ``FusedLayerNorm`` path (the norm module lives in
  ``megatron.core.transformer.norms``).

Nothing here imports ``megatron.core.transformer`` except ``fused_softmax`` (for ``AttnMaskType``), so the
transformer modules import these directly.
"""
