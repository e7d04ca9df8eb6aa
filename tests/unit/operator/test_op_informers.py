"""The body cache that spares reconciles a GET: newest version wins, deletions stick."""
from hicache_operator.control.informers.bodies import BodyCache

KEY = ("ns", "fleet")


def body(rv, generation=1, **status):
    return {"metadata": {"name": "fleet", "namespace": "ns", "resourceVersion": str(rv), "generation": generation},
            "status": status}


def test_newer_replaces_older_does_not():
    c = BodyCache()
    c.offer(KEY, body(10, progress="1/4"))
    c.offer(KEY, body(12, progress="2/4"))  # our status write's response
    c.offer(KEY, body(11, progress="1/4"))  # the watch event of the earlier write, late
    assert c.get(KEY)["status"]["progress"] == "2/4"


def test_same_version_from_watch_and_response_is_kept():
    c = BodyCache()
    c.offer(KEY, body(12, progress="2/4"))
    c.offer(KEY, body(12, progress="2/4"))
    assert c.get(KEY)["metadata"]["resourceVersion"] == "12"


def test_get_returns_a_copy():
    c = BodyCache()
    c.offer(KEY, body(3, progress="0/4"))
    c.get(KEY)["status"]["progress"] = "edited"
    assert c.get(KEY)["status"]["progress"] == "0/4"


def test_deletion_is_not_revived_by_a_late_write_response():
    c = BodyCache()
    c.offer(KEY, body(20))
    c.deleted(KEY, body(22))
    c.offer(KEY, body(21))  # a status write that returned before the delete, offered after it
    assert c.get(KEY) is None
    c.offer(KEY, body(30, generation=1))  # a new object of the same name
    assert c.get(KEY)["metadata"]["resourceVersion"] == "30"


def test_deleted_without_body_blocks_the_same_version():
    c = BodyCache()
    c.offer(KEY, body(5))
    c.deleted(KEY)
    c.offer(KEY, body(5))
    assert c.get(KEY) is None


def test_opaque_resource_versions_are_not_cached():
    c = BodyCache()
    c.offer(KEY, {"metadata": {"resourceVersion": "abc"}})
    assert c.get(KEY) is None
    assert BodyCache().get(KEY) is None
