"""What the tests, benchmarks and demo share: real processes (runtime, router, Mooncake, etcd, the
operator), oracles, checkpoints and load clients; no mocks. ``REPO`` is the checkout they run from."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
