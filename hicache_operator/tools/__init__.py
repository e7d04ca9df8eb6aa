"""Generators run at build time: the CRD from the spec and status models, the docs from the rules."""
