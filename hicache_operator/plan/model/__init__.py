"""The served model: where its checkpoint comes from, its KV shape, the download init container."""
