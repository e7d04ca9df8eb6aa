"""A third-party backend for the ``dynamic`` loader tests: pages in a dict."""

from cache_runtime.storage.base import HiCacheStorage, as_byte_view


class DictStorage(HiCacheStorage):
    def __init__(self, storage_config, kwargs):
        self.storage_config = storage_config
        self.kwargs = kwargs
        self.pages = {}

    def get(self, key, target_location=None, target_sizes=None):
        value = self.pages.get(key)
        if value is None or target_location is None:
            return value
        as_byte_view(target_location, "target").copy_(value)
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, None if target_locations is None else target_locations[i]) for i, k in enumerate(keys)]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self.pages.setdefault(key, as_byte_view(value, "value").clone())
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return all(self.set(k, v) for k, v in zip(keys, values))

    def exists(self, key):
        return key in self.pages


class NotABackend:
    def __init__(self, *args):
        pass
