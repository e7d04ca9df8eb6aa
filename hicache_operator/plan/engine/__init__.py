"""The engine a spec runs: SGLang releases and their features, and the engine's command line."""
