"""The Redis read model: store, codec, key names, indexes, analytics readers and Lua scripts."""
