"""Tokenizers, the token shard writer and reader, and the token-count catalog."""
