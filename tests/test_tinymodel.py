"""The tiny model's one shared copy: vLLM keys its compile caches by the model's path, so the
demo, ``run``, ``sweep`` and every test serve it from one place, built safely by whoever is first."""

from __future__ import annotations

import json
import threading

from tokenizers import Tokenizer

from ttftscope.tinymodel import build_tiny_model, shared_tiny_model

FILES = {"config.json", "tokenizer.json", "tokenizer_config.json"}


def _complete(p) -> bool:
    return {f.name for f in p.iterdir()} == FILES and json.loads((p / "config.json").read_text())["vocab_size"] > 0


def test_one_copy_in_the_users_cache_built_by_the_first_of_many(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    got: list = []
    builders = [threading.Thread(target=lambda: got.append(shared_tiny_model())) for _ in range(4)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    assert len(set(got)) == 1, got
    p = got[0]
    assert p.parent == tmp_path / "cache" / "ttftscope" and p.name.startswith("tinymodel-")
    assert _complete(p)
    assert [q.name for q in p.parent.iterdir()] == [p.name], "no half-built copy left beside it"
    assert Tokenizer.from_file(str(p / "tokenizer.json")).encode("the time to first token").ids
    before = (p / "tokenizer.json").stat().st_mtime_ns
    assert shared_tiny_model() == p and (p / "tokenizer.json").stat().st_mtime_ns == before, "built once"


def test_a_partly_written_directory_is_completed(tmp_path):
    p = tmp_path / "m"
    p.mkdir()
    (p / "config.json").write_text("{}")  # as a build that died half-way
    assert build_tiny_model(p) == p and _complete(p)
    assert [q.name for q in tmp_path.iterdir()] == ["m"]
