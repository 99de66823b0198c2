"""The embedded corpus and tokenizer: real text, deterministic, cached."""

import json

from torchtitan_npu.assets import builder, ensure_default_assets


def test_assets_are_built_once_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path / "a"))
    first = ensure_default_assets()
    stamp = (first.root / "meta.json").stat().st_mtime_ns
    assert ensure_default_assets() == first  # cached
    assert (first.root / "meta.json").stat().st_mtime_ns == stamp
    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path / "b"))
    second = ensure_default_assets()
    assert second.corpus_sha256 == first.corpus_sha256
    tokenizer = (first.tokenizer_path / "tokenizer.json").read_bytes()
    assert (second.tokenizer_path / "tokenizer.json").read_bytes() == tokenizer


def test_corpus_is_english_prose_and_tokenizer_fits_the_debug_model(
    tmp_path, monkeypatch
):
    from tokenizers import Tokenizer

    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path))
    assets = ensure_default_assets()
    lines = (assets.dataset_path / "data.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    assert len(texts) > 500 and sum(map(len, texts)) > 300_000
    assert any(" the " in t for t in texts)
    tokenizer = Tokenizer.from_file(str(assets.tokenizer_path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == builder.VOCAB_SIZE
    ids = tokenizer.encode("Return the value of the attribute.").ids
    assert tokenizer.decode(ids) == "Return the value of the attribute."
    assert len(ids) < 12  # merges learned real words


def test_a_second_validation_build_leaves_nothing_behind(tmp_path, monkeypatch):
    """Two processes building the held-out set at once: one wins, the other's
    staging folder is removed."""
    monkeypatch.setenv("TITAN_NPU_CACHE", str(tmp_path))
    assets = ensure_default_assets()
    held_out = (assets.validation_path / "data.jsonl").read_bytes()
    builder._build_validation(assets.root)  # as if it had lost the race
    assert sorted(p.name for p in assets.root.iterdir()) == [
        "dataset", "meta.json", "tokenizer", "validation",
    ]  # fmt: skip
    assert (assets.validation_path / "data.jsonl").read_bytes() == held_out
