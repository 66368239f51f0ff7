"""Generation and agent episodes: on-device sampling with a KV cache, host-side tools."""
