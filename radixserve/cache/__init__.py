"""KV memory: the paged pool and (later) the radix tree of cached prefixes."""
