"""Constants and helpers shared by the serving tests (a module with a unique name: conftest modules cannot be imported)."""

from __future__ import annotations

from rag.knowledge.passages import Passage

TOKEN = "s3cret-admin-token-for-serve-tests"
API_KEY = "test-api-key-0123456789abcdef"
XSS_TEXT = ('<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2"> '
            '<b onmouseover="window.__xss = 3">bold?</b> the atomic number of iron is 26')
XSS_TITLE = '<img src=x onerror="window.__xss = 4">Iron'


def tagged(passages, tag):
    return [Passage(p.id, p.title, f"[{tag}] {p.text}") for p in passages]
