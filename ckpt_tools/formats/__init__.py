"""Readers of on-disk forms beyond our own (which shards.py and megatron_lm.py read): one module per form."""
