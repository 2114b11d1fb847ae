"""megatron-core's experimental attention variants: DeepSeek sparse attention (:mod:`.dsa`)."""
