"""Local test clusters only: a stand-in for the `sglang` package (see launch_server)."""
