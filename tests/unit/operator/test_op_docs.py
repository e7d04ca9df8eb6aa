"""The generated reference pages match the models and the rule table."""

from __future__ import annotations

from hicache_operator.tools import docgen


def test_committed_docs_match_the_models():
    assert docgen.main(["--check"]) == 0, "run: python -m hicache_operator.tools.docgen"


def test_reference_lists_every_spec_field_and_rule():
    ref = docgen.crd_reference()
    for field in ("`engine`", "`hicache.storage.backend`", "`rollout.maxUnavailable`", "`backendSwap`"):
        assert field in ref
    page = docgen.rules_page()
    assert "`write-back-not-allowed`" in page and "CEL + operator" in page
