"""InferenceParams: the state kept between generation steps (KV cache and offsets)."""


class InferenceParams:
    def __init__(self, max_batch_size: int, max_sequence_length: int):
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict = {}

    def swap_key_value_dict(self, batch_idx):
        """Reorder the cached keys and values along the batch dimension (beam search)."""
        if len(self.key_value_memory_dict) == 0:
            raise ValueError("should not swap when dict in empty")
        for layer_number, (key, value) in self.key_value_memory_dict.items():
            assert len(batch_idx) == key.shape[1]  # [s, b, np, hn]
            self.key_value_memory_dict[layer_number] = (key[:, batch_idx], value[:, batch_idx])
