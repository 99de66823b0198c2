"""Embedded default assets: a text corpus and a tokenizer built locally.

Nothing is downloaded and no third-party prose is committed: the corpus is the
English documentation that ships inside the Python standard library (module,
class and function docstrings of a fixed list of modules), and the tokenizer is
a byte-level BPE trained on that corpus. Both are deterministic for a given
Python version and are cached after the first build.
"""

from torchtitan_npu.assets.builder import DefaultAssets, ensure_default_assets

__all__ = ["DefaultAssets", "ensure_default_assets"]
